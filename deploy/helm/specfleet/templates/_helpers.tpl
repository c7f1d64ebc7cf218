{{/*
Names, labels, images and the Redis connection: each decided here, once, for every template.
*/}}

{{- define "specfleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object; (dict "root" $ "component" "gateway") */}}
{{- define "specfleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: specfleet
{{ include "specfleet.selectorLabels" . }}
{{- end -}}

{{/* What a Deployment, Service or PodDisruptionBudget selects its pods by. */}}
{{- define "specfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- if .model }}
specfleet.io/model: {{ include "specfleet.modelSlug" .model }}
{{- end }}
{{- end -}}

{{/* A model name (letters, digits, _ . -) as a Kubernetes name part: lower case, _ and . as -. */}}
{{- define "specfleet.modelSlug" -}}
{{- .name | lower | replace "_" "-" | replace "." "-" | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* The worker Deployment (and its PodDisruptionBudget and ScaledObject) of one model. */}}
{{- define "specfleet.workerName" -}}
{{- printf "%s-worker-%s" (include "specfleet.fullname" .root) (include "specfleet.modelSlug" .model) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* An image reference; (dict "root" $ "image" .Values.images.gateway) */}}
{{- define "specfleet.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{- define "specfleet.redisService" -}}
{{- printf "%s-redis" (include "specfleet.fullname" .) -}}
{{- end -}}

{{/* The Secret holding the ACL users' passwords (the chart's own Redis with ACL on). */}}
{{- define "specfleet.aclSecret" -}}
{{- required "redis.acl.existingSecret: name the Secret with keys worker-password, client-password and admin-password (or set redis.acl.enabled=false)" .Values.redis.acl.existingSecret -}}
{{- end -}}

{{- define "specfleet.externalSecret" -}}
{{- required "redis.external.existingSecret: name the Secret with keys worker-url and client-url" .Values.redis.external.existingSecret -}}
{{- end -}}

{{/*
REDIS_URL of a role (worker, client), with no secret in the manifest: from the external
Secret, or composed by Kubernetes from REDIS_ADDRESS, REDIS_USERNAME and REDIS_PASSWORD (from
the ACL Secret). The KEDA redis trigger reads the same three variables from the worker.
(dict "root" $ "role" "worker")
*/}}
{{- define "specfleet.redisEnv" -}}
{{- $values := .root.Values -}}
{{- if $values.redis.external.enabled }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef: {name: {{ include "specfleet.externalSecret" .root }}, key: {{ .role }}-url}
{{- else }}
- name: REDIS_ADDRESS
  value: {{ printf "%s.%s.svc:6379" (include "specfleet.redisService" .root) .root.Release.Namespace }}
{{- if $values.redis.acl.enabled }}
- name: REDIS_USERNAME
  value: {{ printf "%s-%s" $values.prefix .role }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ include "specfleet.aclSecret" .root }}, key: {{ .role }}-password}
- name: REDIS_URL
  value: redis://$(REDIS_USERNAME):$(REDIS_PASSWORD)@$(REDIS_ADDRESS)/0
{{- else }}
- name: REDIS_URL
  value: redis://$(REDIS_ADDRESS)/0
{{- end }}
{{- end }}
- name: SPECFLEET_PREFIX
  value: {{ $values.prefix | quote }}
- name: SPECFLEET_LOG_FORMAT
  value: json
{{- end -}}

{{/* name: value pairs of a values map as container env entries. */}}
{{- define "specfleet.extraEnv" -}}
{{- range $name, $value := . }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end -}}

{{/* The keda block with a model's own keda keys (minReplicaCount, ...) over it, as YAML;
(dict "root" $ "model" $m) */}}
{{- define "specfleet.modelKeda" -}}
{{- $keda := deepCopy .root.Values.keda -}}
{{- range $key, $value := (default dict .model.keda) -}}
{{- $_ := set $keda $key $value -}}
{{- end -}}
{{- toYaml $keda -}}
{{- end -}}

{{/* Scaling from zero on the queue lists: the gateway queues requests for a model with no live
worker (else they would wait in the gateway, where the redis trigger cannot see them). */}}
{{- define "specfleet.requireLiveWorker" -}}
{{- $zero := false -}}
{{- if and .Values.keda.enabled (eq .Values.keda.trigger "redis") -}}
{{- range .Values.models -}}
{{- $keda := include "specfleet.modelKeda" (dict "root" $ "model" .) | fromYaml -}}
{{- if eq (int $keda.minReplicaCount) 0 -}}
{{- $zero = true -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- ternary "false" "true" $zero -}}
{{- end -}}

{{/* The pods' security context: the images' unprivileged user. */}}
{{- define "specfleet.podSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{- define "specfleet.containerSecurity" -}}
allowPrivilegeEscalation: false
capabilities: {drop: [ALL]}
{{- end -}}
