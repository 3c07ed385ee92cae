{{- define "rstream-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "rstream-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "rstream-operator.labels" -}}
app.kubernetes.io/name: {{ include "rstream-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rstream
{{- end }}

{{- define "rstream-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rstream-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: manager
{{- end }}

{{/* The manager image: by digest when one is set, else by tag (empty: the chart's appVersion). */}}
{{- define "rstream-operator.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end }}

{{/* The agents' image: agent.image.repository with its digest or tag (empty: image.tag, else the
chart's appVersion); without a repository, the manager's image. */}}
{{- define "rstream-operator.agentImage" -}}
{{- $agent := .Values.agent.image -}}
{{- if not $agent.repository -}}
{{- include "rstream-operator.image" . -}}
{{- else if $agent.digest -}}
{{- printf "%s@%s" $agent.repository $agent.digest -}}
{{- else -}}
{{- printf "%s:%s" $agent.repository (default (default .Chart.AppVersion .Values.image.tag) $agent.tag) -}}
{{- end -}}
{{- end }}

{{/* The port of a bind address (":8080", "0.0.0.0:8080", "[::]:8080"). */}}
{{- define "rstream-operator.port" -}}
{{- splitList ":" . | last -}}
{{- end }}

{{/* Whether the metrics endpoint is on ("0" turns it off): "true" or "". */}}
{{- define "rstream-operator.metricsOn" -}}
{{- if ne (toString .Values.metrics.bindAddress) "0" }}true{{ end -}}
{{- end }}
