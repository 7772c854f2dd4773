{{- define "kvgate.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvgate.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvgate.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
{{- end -}}

{{/* The Secret holding tenants.toml and redis-password: the chart's own or auth.existingSecret. */}}
{{- define "kvgate.secretName" -}}
{{- .Values.auth.existingSecret | default (include "kvgate.fullname" .) -}}
{{- end -}}

{{- define "kvgate.hasRedisPassword" -}}
{{- if or .Values.auth.existingSecret .Values.redis.password }}true{{ end -}}
{{- end -}}

{{/* The Redis URL; $(REDIS_PASSWORD) is expanded by Kubernetes from the container's env. */}}
{{- define "kvgate.redisUrl" -}}
{{- if .Values.redis.enabled -}}
redis://{{ if include "kvgate.hasRedisPassword" . }}:$(REDIS_PASSWORD)@{{ end }}{{ include "kvgate.fullname" . }}-redis:6379/0
{{- else -}}
{{ required "redis.externalUrl is required when redis.enabled is false" .Values.redis.externalUrl }}
{{- end -}}
{{- end -}}

{{/* The REDIS_PASSWORD env entry (a YAML list item), or "" when Redis has no password. */}}
{{- define "kvgate.redisPasswordEnv" -}}
{{- if include "kvgate.hasRedisPassword" . -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvgate.secretName" . }}
      key: redis-password
{{- end -}}
{{- end -}}

{{/*
The kvgate agent as a sidecar of a vLLM container serving on workers.port. Include it in your own
vLLM pod spec: {{ include "kvgate.agentContainer" . | nindent 8 }} (templates/workers.yaml does).
*/}}
{{- define "kvgate.agentContainer" -}}
- name: kvgate-agent
  image: {{ include "kvgate.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args:
    - agent
    - --worker-url=http://127.0.0.1:{{ .Values.workers.port }}
    - --model={{ .Values.workers.model }}
    - --worker-id=$(POD_NAME)
    - --max-concurrency={{ .Values.workers.agent.maxConcurrency }}
    - --heartbeat-ms={{ .Values.workers.agent.heartbeatMs }}
    {{- if .Values.workers.kvEvents.enabled }}
    - --kv-events=tcp://127.0.0.1:{{ .Values.workers.kvEvents.port }}
    - --router-block-size={{ .Values.workers.agent.routerBlockSize }}
    {{- end }}
    - --host=0.0.0.0
    - --port={{ .Values.workers.agent.port }}
  env:
    - name: POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    {{- with include "kvgate.redisPasswordEnv" . }}{{ . | nindent 4 }}{{ end }}
    - name: KVGATE_REDIS_URL
      value: {{ include "kvgate.redisUrl" . | quote }}
  ports:
    - {name: agent, containerPort: {{ .Values.workers.agent.port }}}
  readinessProbe:
    httpGet: {path: /healthz, port: agent}
    periodSeconds: 5
  lifecycle:
    preStop:
      exec:
        # stop new routing to this worker and wait for its in-flight requests (bounded by the grace period)
        command: ["sh", "-c", "kvgate drain \"$POD_NAME\" --model {{ .Values.workers.model }} --wait --timeout-s {{ sub .Values.workers.terminationGracePeriodSeconds 20 }}"]
  resources:
    {{- toYaml .Values.workers.agent.resources | nindent 4 }}
  securityContext:
    readOnlyRootFilesystem: true
    allowPrivilegeEscalation: false
    runAsNonRoot: true
{{- end -}}
