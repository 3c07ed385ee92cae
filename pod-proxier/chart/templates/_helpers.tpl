{{- define "pod-proxier.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pod-proxier.labels" -}}
app.kubernetes.io/name: pod-proxier
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "pod-proxier.selector" -}}
app.kubernetes.io/name: pod-proxier
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pod-proxier.serviceAccount" -}}
{{- default (include "pod-proxier.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* The flags, shared by the proxy and the HAProxy config generator. */}}
{{/* The V1 entry ports, START-END (one port with v1SharedPort). */}}
{{- define "pod-proxier.v1Ports" -}}
{{- $first := int .Values.ports.defaultMapPort -}}
{{- if .Values.podProxier.v1SharedPort -}}
{{ $first }}-{{ $first }}
{{- else -}}
{{ $first }}-{{ add $first (sub (int .Values.podProxier.v1PortCount) 1) }}
{{- end -}}
{{- end -}}

{{- define "pod-proxier.args" -}}
{{- $p := .Values.podProxier -}}
{{- if $p.enableV1 }}
- --enable-v1
{{- end }}
{{- if $p.enableV2 }}
- --enable-v2
{{- end }}
- --listen-port={{ .Values.ports.podProxierPort }}
- --listen-addr={{ $p.listenAddr }}
- --default-map-port={{ .Values.ports.defaultMapPort }}
{{- if $p.v1SharedPort }}
- --v1-shared-port
{{- else }}
- --v1-port-range={{ include "pod-proxier.v1Ports" . }}
{{- end }}
- --entry-access={{ $p.entryAccess }}
{{- with $p.allowedSourceCidrs }}
- --allowed-source-cidrs={{ join "," . }}
{{- end }}
- --jprofiler-port-name={{ .Values.ports.jprofilerPortName }}
- --health-addr=0.0.0.0:{{ .Values.ports.healthPort }}
- --metrics-addr=0.0.0.0:{{ .Values.ports.metricsPort }}
- --metrics-secure={{ .Values.metricsSecure }}
- --port-name={{ $p.portName }}
- --port-range-start={{ $p.portRangeStart }}
- --port-range-end={{ $p.portRangeEnd }}
- --allowed-namespaces={{ join "," $p.allowedNamespaces }}
- --max-mapping-time={{ $p.maxMappingTime }}
- --check-timeout={{ $p.checkTimeout }}
- --check-interval={{ $p.checkInterval }}
{{- if $p.offCheck }}
- --off-check
{{- end }}
{{- if gt (int $p.peerCheckInterval) 0 }}
- --peer-selector=app.kubernetes.io/name=pod-proxier,app.kubernetes.io/instance={{ .Release.Name }}
- --peer-check-interval={{ $p.peerCheckInterval }}s
- --peer-check-failures={{ $p.peerCheckFailures }}
{{- end }}
- --resync-time={{ $p.resyncTime }}
- --v2-target={{ $p.v2Target }}
- --backend={{ $p.backend }}
{{- if ne $p.backend "haproxy" }}
- --data-path={{ $p.dataPath }}
{{- end }}
- --api-addr=unix:///run/haproxy/admin.sock
- --auth={{ $p.auth }}
- --log-level={{ $p.logLevel }}
- --log-format={{ $p.logFormat }}
- --drain-timeout={{ $p.drainTimeout }}
- --header-read-timeout={{ $p.headerReadTimeout }}
- --request-timeout={{ $p.requestTimeout }}
- --max-api-connections={{ $p.maxApiConnections }}
- --max-body-bytes={{ $p.maxBodyBytes }}
{{- if .Values.tls.enabled }}
- --tls-cert-file=/etc/pod-proxier/tls/tls.crt
- --tls-key-file=/etc/pod-proxier/tls/tls.key
{{- else }}
- --plain-http
{{- end }}
{{- end -}}

{{/* The Secret the API's certificate is read from: the user's, or the chart's own. */}}
{{- define "pod-proxier.tlsSecret" -}}
{{- .Values.tls.secretName | default (printf "%s-tls" (include "pod-proxier.fullname" .)) -}}
{{- end -}}

{{/* The Service's DNS names, and the extra ones of tls.altNames.dns. */}}
{{- define "pod-proxier.tlsDnsNames" -}}
{{- $name := include "pod-proxier.fullname" . -}}
{{- $ns := .Release.Namespace -}}
{{- $names := list $name (printf "%s.%s" $name $ns) (printf "%s.%s.svc" $name $ns) (printf "%s.%s.svc.cluster.local" $name $ns) -}}
{{- concat $names .Values.tls.altNames.dns | toJson -}}
{{- end -}}

{{/* An image reference from {repository, tag, digest}: by digest when one is set, else by tag
(empty: the chart's appVersion). Called with (list $image $root). */}}
{{- define "pod-proxier.imageRef" -}}
{{- $image := index . 0 -}}
{{- $root := index . 1 -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}
