{{- define "steward.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "steward.serviceName" -}}
{{- default (include "steward.fullname" .) .Values.serviceName -}}
{{- end -}}

{{- define "steward.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "steward.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The image: by digest when one is set, else by tag (empty: the chart's appVersion). */}}
{{- define "steward.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* A Go duration ("1m30s", "500ms", "0") in seconds, as a float. */}}
{{- define "steward.seconds" -}}
{{- $units := dict "ns" 0.000000001 "us" 0.000001 "µs" 0.000001 "ms" 0.001 "s" 1.0 "m" 60.0 "h" 3600.0 -}}
{{- $total := 0.0 -}}
{{- range regexFindAll `[0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h)` (toString .) -1 -}}
{{- $number := regexFind `^[0-9]+(\.[0-9]+)?` . -}}
{{- $unit := trimPrefix $number . -}}
{{- $total = addf $total (mulf (float64 $number) (get $units $unit)) -}}
{{- end -}}
{{- $total -}}
{{- end -}}

{{/* SIGTERM to exit: shutdownDelay (still accepting) + drainTimeout (draining) + 5 s for the
process to exit, whole seconds rounded up. */}}
{{- define "steward.gracePeriod" -}}
{{- $delay := include "steward.seconds" .Values.shutdownDelay | float64 -}}
{{- $drain := include "steward.seconds" .Values.drainTimeout | float64 -}}
{{- addf $delay $drain 5 | ceil | int -}}
{{- end -}}
