{{/* Names and labels. */}}
{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgate.fullname" -}}
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

{{- define "kvgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "gateway"). */}}
{{- define "kvgate.selector" -}}
app.kubernetes.io/name: {{ include "kvgate.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvgate.image" -}}
{{- $img := .image -}}
{{- printf "%s:%s" $img.repository (default .ctx.Chart.AppVersion $img.tag) }}
{{- end }}

{{- define "kvgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvgate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvgate.workersName" -}}
{{- printf "%s-worker" (include "kvgate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgate.redisName" -}}
{{- printf "%s-redis" (include "kvgate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgate.lmcacheName" -}}
{{- printf "%s-lmcache" (include "kvgate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The Redis URL kvgate and LMCache use, unless it comes from a Secret. */}}
{{- define "kvgate.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s:6379/0" (include "kvgate.redisName" .) }}
{{- else }}
{{- .Values.redis.url }}
{{- end }}
{{- end }}

{{- define "kvgate.gracePeriod" -}}
{{- if .Values.gateway.terminationGracePeriodSeconds }}
{{- .Values.gateway.terminationGracePeriodSeconds }}
{{- else }}
{{- add (int (ceil (index (merge (dict) .Values.extraConfig .Values.config) "drain_timeout_s"))) .Values.gateway.preStopSleepSeconds 10 }}
{{- end }}
{{- end }}

{{/* The workers this chart runs, as kvgate.yaml entries: stable StatefulSet pod names. */}}
{{- define "kvgate.workerEntries" -}}
{{- $ws := list }}
{{- if ne .Values.workers.mode "none" }}
{{- $name := include "kvgate.workersName" . }}
{{- range $i := until (int .Values.workers.replicas) }}
{{- $host := printf "%s-%d.%s.%s.svc" $name $i $name $.Release.Namespace }}
{{- $w := dict "id" (printf "%s-%d" $name $i) "url" (printf "http://%s:%d" $host (int $.Values.workers.port)) "model" $.Values.workers.model "engine" "vllm" "block_size" (int $.Values.workers.blockSize) "hash_algo" $.Values.workers.hashAlgo "kv_events" (printf "tcp://%s:%d" $host (int $.Values.workers.kvEventsPort)) "kv_replay" (printf "tcp://%s:%d" $host (int $.Values.workers.kvReplayPort)) }}
{{- if and (eq $.Values.workers.mode "vllm") $.Values.lmcache.enabled }}
{{- $_ := set $w "node" (include "kvgate.lmcacheName" $) }}
{{- $_ := set $w "lmcache_url" (printf "http://%s:%d" (include "kvgate.lmcacheName" $) (int $.Values.lmcache.httpPort)) }}
{{- $_ := set $w "lmcache_model" $.Values.workers.vllm.modelPath }}
{{- end }}
{{- $ws = append $ws $w }}
{{- end }}
{{- end }}
{{- concat $ws .Values.workers.external | toJson }}
{{- end }}

{{- define "kvgate.securityContext" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
{{- end }}

{{- define "kvgate.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "kvgate.eppName" -}}
{{- printf "%s-epp" (include "kvgate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgate.poolName" -}}
{{- default (include "kvgate.fullname" .) .Values.epp.inferencePool.name }}
{{- end }}

{{/* The InferencePool's pod selector (YAML): given, else the workers this chart runs. */}}
{{- define "kvgate.poolSelector" -}}
{{- if .Values.epp.inferencePool.selector }}
{{- toYaml .Values.epp.inferencePool.selector }}
{{- else if ne .Values.workers.mode "none" }}
{{- include "kvgate.selector" (dict "ctx" . "component" "worker") }}
{{- else }}
{{- fail "epp.inferencePool.selector is required when workers.mode is none" }}
{{- end }}
{{- end }}
