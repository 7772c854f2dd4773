{{- define "kvgate.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvgate.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvgate.redisUrl" -}}
{{- if .Values.redis.enabled -}}
redis://{{ include "kvgate.fullname" . }}-redis:6379/0
{{- else -}}
{{ required "redis.externalUrl is required when redis.enabled is false" .Values.redis.externalUrl }}
{{- end -}}
{{- end -}}
