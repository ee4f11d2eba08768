{{/*
Worker pod pieces shared by the StatefulSet (one pod per instance) and the LeaderWorkerSet (a leader that
serves plus follower pods that only lend GPUs to the leader's Ray cluster).
Every define takes (dict "root" $ "name" <pool name> "pool" <merged pool settings>).
*/}}

{{/* Labels of a serving worker pod; pdserve.io/role and the `http` port are what router discovery reads. */}}
{{- define "pdserve.workerLabels" -}}
{{ include "pdserve.labels" .root }}
app.kubernetes.io/component: worker
pdserve.io/pool: {{ .name }}
pdserve.io/role: {{ .name }}
{{- end }}

{{- define "pdserve.workerSelectorLabels" -}}
{{ include "pdserve.selectorLabels" .root }}
app.kubernetes.io/component: worker
pdserve.io/pool: {{ .name }}
{{- end }}

{{/* Follower pods of a multi-node instance: no role label, so the router never routes to them. */}}
{{- define "pdserve.followerLabels" -}}
{{ include "pdserve.labels" .root }}
app.kubernetes.io/component: worker-follower
pdserve.io/pool: {{ .name }}
{{- end }}

{{- define "pdserve.workerResources" -}}
{{- $gpus := include "pdserve.gpusPerPod" .pool | int }}
{{- $devices := dict .root.Values.worker.gpuResource $gpus }}
{{- if .pool.rdma.enabled }}
{{- $_ := set $devices .pool.rdma.resourceName (int .pool.rdma.count) }}
{{- end }}
{{- $requests := merge (deepCopy $devices) (default dict .pool.resources.requests) }}
{{- $limits := merge (deepCopy $devices) (default dict .pool.resources.limits) }}
{{- toYaml (dict "requests" $requests "limits" $limits) }}
{{- end }}

{{- define "pdserve.workerArgs" -}}
- worker
- --host=0.0.0.0
- --port={{ .root.Values.worker.port }}
- --channel-port={{ .root.Values.worker.channelPort }}
- --model=$(PDSERVE_MODEL_DIR)
- --role={{ .name }}
- --ranks={{ .pool.ranks }}
- --page-size=$(PDSERVE_PAGE_SIZE)
- --gpu-memory-fraction=$(PDSERVE_GPU_MEMORY_FRACTION)
- --decode-reserve-tokens=$(PDSERVE_DECODE_RESERVE_TOKENS)
- --drain-timeout-s={{ .root.Values.worker.terminationGracePeriodSeconds }}
{{- if .pool.expertParallel }}
- --expert-parallel
{{- end }}
{{- if .pool.hostKvCacheGiB }}
- --host-kv-cache-gib={{ .pool.hostKvCacheGiB }}
{{- end }}
{{- /* The fit check counted one byte a weight: the FP8 linears must stay FP8 (auto could dequantize them). */}}
{{- if eq (int .root.Values.model.weightBytes) 1 }}
- --fp8-weights=keep
{{- end }}
{{- /* Hand-off peers: the pods discovery names, under the URL it names them by (the pod IP). */}}
- --advertise-url=http://$(POD_IP):{{ .root.Values.worker.port }}
- --discovery=k8s
- --k8s-namespace={{ .root.Release.Namespace }}
- --k8s-label-selector={{ include "pdserve.discoverySelector" .root }}
{{- range .root.Values.worker.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* The pod spec of a worker pod; "follower" true gives a multi-node follower (Ray node only). */}}
{{- define "pdserve.workerPodSpec" -}}
{{- $root := .root }}
{{- $pool := .pool }}
{{- $multiNode := $pool.multiNode.enabled }}
{{- $rayPort := $pool.multiNode.rayPort }}
{{- $gpus := include "pdserve.gpusPerPod" $pool -}}
serviceAccountName: {{ include "pdserve.workerServiceAccountName" $root }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- /* Drain budget: the preStop wait, then the worker's own drain (--drain-timeout-s, after SIGTERM), then a margin
       for the process to exit (cut KV-event streams, release its Ray actors) before the kubelet's SIGKILL. */}}
terminationGracePeriodSeconds: {{ add $root.Values.worker.terminationGracePeriodSeconds $root.Values.worker.preStopSleepSeconds 15 }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if eq $root.Values.model.source "download" }}
initContainers:
  {{- include "pdserve.modelDownloadInit" (dict "root" $root "files" "") | nindent 2 }}
{{- end }}
containers:
  - name: {{ if .follower }}ray-follower{{ else }}worker{{ end }}
    image: {{ include "pdserve.image" $root }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    {{- if .follower }}
    command: ["sh", "-ec"]
    args:
      - exec ray start --address="${LWS_LEADER_ADDRESS}":{{ $rayPort }} --num-gpus={{ $gpus }} --block
    {{- else if $multiNode }}
    command: ["sh", "-ec"]
    args:
      - |
        ray start --head --port={{ $rayPort }} --num-gpus={{ $gpus }} --disable-usage-stats
        exec pdserve {{ include "pdserve.workerArgs" . | fromYamlArray | join " " }} --ray-address=127.0.0.1:{{ $rayPort }}
    {{- else }}
    command: ["pdserve"]
    args:
      {{- include "pdserve.workerArgs" . | nindent 6 }}
    {{- end }}
    envFrom:
      - configMapRef:
          name: {{ include "pdserve.fullname" $root }}-engine
    env:
      - name: POD_NAME
        valueFrom: {fieldRef: {fieldPath: metadata.name}}
      - name: POD_IP
        valueFrom: {fieldRef: {fieldPath: status.podIP}}
      {{- include "pdserve.internalTokenEnv" $root | nindent 6 }}
      # Ray checks this token on every call between the pods of an instance (and locally).
      - {name: RAY_AUTH_MODE, value: token}
      - name: RAY_AUTH_TOKEN
        valueFrom:
          secretKeyRef: {name: {{ include "pdserve.internalSecretName" $root }}, key: ray-token}
      - {name: UCX_TCP_PORT_RANGE, value: {{ $root.Values.worker.transferPortRange | quote }}}
      - {name: HOME, value: /home/pdserve}
      {{- with $root.Values.worker.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- if not .follower }}
    ports:
      - name: http
        containerPort: {{ $root.Values.worker.port }}
        protocol: TCP
      - name: channel
        containerPort: {{ $root.Values.worker.channelPort }}
        protocol: TCP
      {{- if $multiNode }}
      - name: ray
        containerPort: {{ $rayPort }}
        protocol: TCP
      {{- end }}
    {{- /* /health is 503 while loading, draining or unhealthy. The startup probe covers model loading;
           kubelet stops liveness probes once a pod terminates, so a draining 503 only affects readiness. */}}
    startupProbe:
      httpGet: {path: /health, port: http}
      periodSeconds: 10
      failureThreshold: {{ div $root.Values.worker.startupTimeoutSeconds 10 | max 1 }}
    readinessProbe:
      httpGet: {path: /health, port: http}
      periodSeconds: 5
      failureThreshold: 2
    livenessProbe:
      httpGet: {path: /health, port: http}
      periodSeconds: 15
      timeoutSeconds: 5
      failureThreshold: 4
    lifecycle:
      preStop:
        exec:
          command: ["sleep", "{{ $root.Values.worker.preStopSleepSeconds }}"]
    {{- end }}
    resources:
      {{- include "pdserve.workerResources" . | nindent 6 }}
    securityContext:
      {{- include "pdserve.containerSecurityContext" (dict "add" (ternary (list "IPC_LOCK") list $root.Values.worker.ipcLock)) | nindent 6 }}
    volumeMounts:
      {{- include "pdserve.modelVolumeMount" $root | nindent 6 }}
      {{- include "pdserve.scratchVolumeMounts" $root | nindent 6 }}
      - name: shm
        mountPath: /dev/shm
volumes:
  {{- include "pdserve.modelVolume" $root | nindent 2 }}
  {{- include "pdserve.scratchVolumes" $root | nindent 2 }}
  - name: shm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $root.Values.worker.shmSize }}
{{- with $pool.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $pool.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $pool.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Rolls worker pods when engine settings change; adds scrape annotations when no operator is used. */}}
{{- define "pdserve.workerPodAnnotations" -}}
checksum/engine-config: {{ include (print .root.Template.BasePath "/engine-configmap.yaml") .root | sha256sum }}
{{- if not .follower }}
{{- include "pdserve.scrapeAnnotations" (dict "root" .root "port" .root.Values.worker.port) }}
{{- end }}
{{- end }}
