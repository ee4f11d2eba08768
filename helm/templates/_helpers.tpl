{{/* Names, labels and pod-spec pieces shared by the router and worker templates. */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Object-name prefix; kept to 40 characters so pool and LWS pod names stay under 63. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "pdserve.workerServiceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- printf "%s-worker" (include "pdserve.serviceAccountName" .) }}
{{- else }}
{{- default (include "pdserve.serviceAccountName" .) .Values.serviceAccount.workerName }}
{{- end }}
{{- end }}

{{- define "pdserve.plannerServiceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- printf "%s-planner" (include "pdserve.serviceAccountName" .) }}
{{- else }}
{{- default (include "pdserve.serviceAccountName" .) .Values.serviceAccount.plannerName }}
{{- end }}
{{- end }}

{{- define "pdserve.routerImage" -}}
{{- printf "%s:%s" .Values.image.routerRepository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Labels that select every pod of this release; the router's discovery selector starts with them. */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
helm.sh/chart: {{ include "pdserve.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{/*
The router lists pods matching this selector. Only serving worker pods carry pdserve.io/role, so the
"exists" term keeps the router's own pods and multi-node follower pods out of discovery.
*/}}
{{- define "pdserve.discoverySelector" -}}
{{- printf "app.kubernetes.io/instance=%s,app.kubernetes.io/name=%s,pdserve.io/role" .Release.Name (include "pdserve.name" .) }}
{{- end }}

{{/* The planner finds the routers, whose /metrics it reads, by this selector. */}}
{{- define "pdserve.routerSelector" -}}
{{- printf "app.kubernetes.io/instance=%s,app.kubernetes.io/name=%s,app.kubernetes.io/component=router" .Release.Name (include "pdserve.name" .) }}
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* A pool's settings: poolDefaults overlaid with the pool's own keys. Call with (dict "root" $ "name" "prefill"). */}}
{{- define "pdserve.pool" -}}
{{- $pool := mergeOverwrite (deepCopy .root.Values.poolDefaults) (deepCopy (get .root.Values.pools .name)) }}
{{- if $pool.multiNode.enabled }}
{{- if ne (mod (int $pool.ranks) (int $pool.multiNode.nodes)) 0 }}
{{- fail (printf "pools.%s: ranks (%v) must divide evenly among multiNode.nodes (%v)" .name $pool.ranks $pool.multiNode.nodes) }}
{{- end }}
{{- end }}
{{- toYaml $pool }}
{{- end }}

{{/* GPUs one pod of a pool requests: all ranks, or its share when an instance spans several nodes. */}}
{{- define "pdserve.gpusPerPod" -}}
{{- if .multiNode.enabled }}{{ div (int .ranks) (int .multiNode.nodes) }}{{ else }}{{ .ranks }}{{ end }}
{{- end }}

{{/* Prometheus scrape annotations, used only when no Prometheus Operator is wanted. */}}
{{- define "pdserve.scrapeAnnotations" -}}
{{- if not .root.Values.monitoring.prometheusOperator.enabled }}
prometheus.io/scrape: "true"
prometheus.io/path: {{ .root.Values.monitoring.metricsPath | quote }}
prometheus.io/port: {{ .port | quote }}
{{- end }}
{{- end }}

{{/* Model volume, chosen by model.source. For "download" the init container fills an emptyDir. */}}
{{- define "pdserve.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "existingClaim" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.existingClaim.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.download.sizeLimit }}
{{- end }}
{{- end }}

{{- define "pdserve.modelVolumeMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- if and (eq .Values.model.source "existingClaim") .Values.model.existingClaim.subPath }}
  subPath: {{ .Values.model.existingClaim.subPath }}
{{- end }}
{{- end }}

{{/* Init container fetching the model; call with (dict "root" $ "files" "<files or empty>"). */}}
{{- define "pdserve.modelDownloadInit" -}}
{{- $d := .root.Values.model.download -}}
- name: fetch-model
  image: {{ $d.image }}
  command: ["sh", "-ec", {{ $d.script | quote }}]
  env:
    - {name: MODEL_REPO, value: {{ $d.repo | quote }}}
    - {name: MODEL_REVISION, value: {{ $d.revision | quote }}}
    - {name: MODEL_FILES, value: {{ .files | quote }}}
    - {name: MODEL_DIR, value: {{ .root.Values.model.mountPath | quote }}}
    - {name: HOME, value: /tmp}
    - {name: PIP_CACHE_DIR, value: /tmp/pip}
    {{- if $d.tokenSecret }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef: {name: {{ $d.tokenSecret }}, key: HF_TOKEN}
    {{- end }}
  securityContext:
    {{- include "pdserve.containerSecurityContext" dict | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ .root.Values.model.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}

{{/* Writable scratch space beside the read-only root: /tmp (Ray's session files, pip in the model fetcher) and the
     kernel caches (flashinfer, triton, torch inductor compile there on first use). */}}
{{- define "pdserve.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
{{- end }}

{{- define "pdserve.scratchVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /home/pdserve/.cache
{{- end }}


{{- define "pdserve.internalSecretName" -}}
{{- default (printf "%s-internal" (include "pdserve.fullname" .)) .Values.internalAuth.existingSecret }}
{{- end }}

{{/* The internal-API credential every router and worker container gets (never on a command line). */}}
{{- define "pdserve.internalTokenEnv" -}}
- name: PDSERVE_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "pdserve.internalSecretName" . }}, key: internal-token}
{{- end }}

{{/* Container security: no privilege escalation, every capability dropped but those given (RDMA needs IPC_LOCK),
     read-only root (writable emptyDirs are mounted where caches and temporary files go). Call with (dict "add" list). */}}
{{- define "pdserve.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
  {{- with .add }}
  add: {{ toJson . }}
  {{- end }}
{{- end }}

{{/*
Refuses a pool whose ranks cannot hold their weights: every rank holds the replicated parameters and its share of
the routed experts (all of them without expert parallelism); what is left of the GPU's budget
(gpuMemoryGiB x gpuMemoryFraction) must keep minKvCacheGiB for the KV cache; and a pod's memory limit must hold its
ranks' host KV tiers. Call with (dict "root" $ "name" n "pool" p).
*/}}
{{- define "pdserve.fitCheck" -}}
{{- $v := .root.Values }}
{{- $shards := ternary (int .pool.ranks) 1 (and .pool.expertParallel (gt (int .pool.ranks) 1)) }}
{{- $paramsB := addf $v.model.size.replicatedParamsB (divf $v.model.size.routedExpertParamsB $shards) }}
{{- $weightsGiB := divf (mulf $paramsB 1e9 $v.model.weightBytes) 1073741824.0 }}
{{- $budgetGiB := mulf $v.worker.gpuMemoryGiB $v.engine.gpuMemoryFraction }}
{{- if gt (addf $weightsGiB $v.worker.minKvCacheGiB) $budgetGiB }}
{{- fail (printf "pools.%s: each rank would hold %.1f GiB of weights (%.2fB replicated + %.2fB routed-expert parameters / %d expert shard(s), %v bytes each), but a GPU gives %.1f GiB (worker.gpuMemoryGiB %v x engine.gpuMemoryFraction %v) and %v GiB must stay for the KV cache; use more ranks with expertParallel: true, larger GPUs, or 1-byte (FP8) weights" .name $weightsGiB $v.model.size.replicatedParamsB $v.model.size.routedExpertParamsB $shards $v.model.weightBytes $budgetGiB $v.worker.gpuMemoryGiB $v.engine.gpuMemoryFraction $v.worker.minKvCacheGiB) }}
{{- end }}
{{- /* The host KV tier is pinned host memory of every rank in the pod: a memory limit (Gi or Ti) below it, plus 16 GiB
for the worker itself (Ray, torch, weight loading), would have the pod OOM-killed once the tier fills. */}}
{{- if .pool.hostKvCacheGiB }}
{{- $limit := toString (dig "limits" "memory" "" .pool.resources) }}
{{- $limitGiB := 0.0 }}
{{- if hasSuffix "Gi" $limit }}{{ $limitGiB = float64 (trimSuffix "Gi" $limit) }}
{{- else if hasSuffix "Ti" $limit }}{{ $limitGiB = mulf (float64 (trimSuffix "Ti" $limit)) 1024 }}{{ end }}
{{- $ranksPerPod := include "pdserve.gpusPerPod" .pool | int }}
{{- $needGiB := addf (mulf $ranksPerPod .pool.hostKvCacheGiB) 16 }}
{{- if and $limitGiB (gt $needGiB $limitGiB) }}
{{- fail (printf "pools.%s: %d rank(s) a pod x hostKvCacheGiB %v + 16 GiB for the worker need %.0f GiB of host memory, but resources.limits.memory is %s; raise the limit or lower hostKvCacheGiB" .name $ranksPerPod .pool.hostKvCacheGiB $needGiB $limit) }}
{{- end }}
{{- end }}
{{- end }}
