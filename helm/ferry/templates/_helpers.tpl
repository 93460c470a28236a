{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "ferry.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name; a release already called "ferry..." is not repeated. */}}
{{- define "ferry.fullname" -}}
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

{{- define "ferry.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ferry.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ferry.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "ferry.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "ferry.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The Secret holding the API key: an existing one, or the one this chart creates. */}}
{{- define "ferry.apiKeySecretName" -}}
{{- default (printf "%s-api-key" (include "ferry.fullname" .)) .Values.server.apiKey.existingSecret }}
{{- end }}

{{- define "ferry.apiKeyEnabled" -}}
{{- if or .Values.server.apiKey.existingSecret .Values.server.apiKey.value }}true{{ end }}
{{- end }}

{{/*
A map of flag values as `ferry serve` arguments, one YAML list item each: null is skipped (the server's
default applies), true/false become --flag/--no-flag, a list one --flag=item per item (the repeatable flags:
--lora-modules), a map --flag=its JSON, anything else --flag=value. Whole numbers are printed as integers: Helm
reads every YAML number as a float, and 10485760 would otherwise print as 1.048576e+07.
*/}}
{{- define "ferry.flags" -}}
{{- range $key, $value := . }}
{{- $flag := kebabcase $key }}
{{- if kindIs "invalid" $value }}
{{- else if kindIs "bool" $value }}
- {{ printf "--%s%s" (ternary "" "no-" $value) $flag | quote }}
{{- else if and (kindIs "float64" $value) (eq $value (floor $value)) }}
- {{ printf "--%s=%d" $flag (int64 $value) | quote }}
{{- else if kindIs "map" $value }}
- {{ printf "--%s=%s" $flag (toJson $value) | quote }}
{{- else if kindIs "slice" $value }}
{{- range $value }}
- {{ printf "--%s=%s" $flag (ternary (toJson .) (toString .) (kindIs "map" .)) | quote }}
{{- end }}
{{- else }}
- {{ printf "--%s=%v" $flag $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* preStop sleep + drain timeout + slack, unless set explicitly; an explicit value must cover both. */}}
{{- define "ferry.terminationGracePeriodSeconds" -}}
{{- $drain := int64 (default 0 .Values.server.drainTimeout) }}
{{- $sleep := int64 .Values.termination.preStopSleepSeconds }}
{{- $grace := .Values.termination.terminationGracePeriodSeconds }}
{{- if kindIs "invalid" $grace }}
{{- add $sleep $drain 30 }}
{{- else if le (int64 $grace) (add $sleep $drain) }}
{{- fail (printf "termination.terminationGracePeriodSeconds (%d) must exceed termination.preStopSleepSeconds + server.drainTimeout (%d), or the kubelet kills ferry mid-drain" (int64 $grace) (add $sleep $drain)) }}
{{- else }}
{{- int64 $grace }}
{{- end }}
{{- end }}

{{/*
Tensor parallelism: checks the layout and says how many pods one model spans (1 unless tensorParallel.nodes > 1,
which renders a LeaderWorkerSet instead of the Deployment).
*/}}
{{- define "ferry.tensorParallelNodes" -}}
{{- $tp := .Values.tensorParallel }}
{{- $size := int64 $tp.size }}
{{- $nodes := int64 $tp.nodes }}
{{- if mod $size $nodes }}
{{- fail (printf "tensorParallel.nodes (%d) must divide tensorParallel.size (%d): every pod runs as many ranks" $nodes $size) }}
{{- end }}
{{- $perPod := div $size $nodes }}
{{- $gpus := int64 .Values.gpu.count }}
{{- if and (gt $size 1) (gt $gpus 0) (ne $gpus $perPod) }}
{{- fail (printf "gpu.count (%d) must be tensorParallel.size / tensorParallel.nodes (%d): one GPU per rank on each pod (0 runs the ranks on CPUs)" $gpus $perPod) }}
{{- end }}
{{- $nodes }}
{{- end }}

{{/* The pods that serve HTTP: every pod, or with a LeaderWorkerSet its leaders only. */}}
{{- define "ferry.servingSelectorLabels" -}}
{{ include "ferry.selectorLabels" . }}
{{- if gt (int64 (include "ferry.tensorParallelNodes" .)) 1 }}
app.kubernetes.io/component: leader
{{- end }}
{{- end }}

{{/* The workload the HPA scales: the Deployment, or the LeaderWorkerSet (one replica: one group of pods). */}}
{{- define "ferry.scaleTarget" -}}
{{- if gt (int64 (include "ferry.tensorParallelNodes" .)) 1 }}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
{{- else }}
apiVersion: apps/v1
kind: Deployment
{{- end }}
name: {{ include "ferry.fullname" . }}
{{- end }}

{{/* `ferry serve` arguments of the tensor-parallel layout; the LeaderWorkerSet gives each pod its index and the
leader's address in LWS_WORKER_INDEX and LWS_LEADER_ADDRESS (the leader's index is 0). */}}
{{- define "ferry.tensorParallelArgs" -}}
{{- $tp := .Values.tensorParallel }}
{{- if gt (int64 $tp.size) 1 }}
- {{ printf "--tensor-parallel-size=%d" (int64 $tp.size) | quote }}
{{- end }}
{{- if gt (int64 $tp.nodes) 1 }}
- {{ printf "--nnodes=%d" (int64 $tp.nodes) | quote }}
- "--node-rank=$(LWS_WORKER_INDEX)"
- "--master-addr=$(LWS_LEADER_ADDRESS)"
- {{ printf "--master-port=%d" (int64 $tp.masterPort) | quote }}
{{- end }}
{{- end }}

{{/* The endpoint picker's pods: a name of their own, so no selector of the model pods ever matches them. */}}
{{- define "ferry.endpointPickerSelectorLabels" -}}
app.kubernetes.io/name: {{ include "ferry.name" . }}-epp
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Stored state (server/state/). The Secret and key FERRY_DATABASE_URL comes from: state.databaseUrl.existingSecret,
the Secret the chart makes of state.databaseUrl.value, or the chart's PostgreSQL's; empty name: no database, the
SQLite file in state.stateDir. Fails the render for a layout that would split the state: several pods (replicas,
or the autoscaler) each with a SQLite file of its own would each answer only for what it stored itself.
*/}}
{{- define "ferry.databaseSecretName" -}}
{{- $url := .Values.state.databaseUrl }}
{{- if and .Values.postgresql.enabled (or $url.existingSecret $url.value) }}
{{- fail "postgresql.enabled and state.databaseUrl both name a database: set one (the chart's PostgreSQL is for trying it; state.databaseUrl points at your own)" }}
{{- end }}
{{- $name := "" }}
{{- if $url.existingSecret }}
{{- $name = $url.existingSecret }}
{{- else if $url.value }}
{{- $name = printf "%s-database" (include "ferry.fullname" .) }}
{{- else if .Values.postgresql.enabled }}
{{- $name = include "ferry.postgresqlName" . }}
{{- end }}
{{- if and (not $name) (or (gt (int64 .Values.replicaCount) 1) .Values.autoscaling.enabled) }}
{{- $why := ternary "autoscaling.enabled is true" (printf "replicaCount is %d" (int64 .Values.replicaCount)) .Values.autoscaling.enabled }}
{{- fail (printf "%s but no database is set: stored responses, conversations, files and batches would be split across pods, each keeping its own SQLite file, so a client would see only what the pod it reached stored. Set state.databaseUrl.existingSecret (a Secret holding a postgresql:// URL; or state.databaseUrl.value), or postgresql.enabled=true (a one-pod PostgreSQL for trying it), or run one replica (replicaCount: 1, autoscaling.enabled: false)" $why) }}
{{- end }}
{{- $name }}
{{- end }}

{{- define "ferry.databaseSecretKey" -}}
{{- if or .Values.state.databaseUrl.existingSecret .Values.state.databaseUrl.value }}
{{- .Values.state.databaseUrl.key }}
{{- else }}database-url{{ end }}
{{- end }}

{{/* `ferry serve` flags of stored state; --state-dir only without a database (the SQLite file's folder). */}}
{{- define "ferry.stateArgs" -}}
{{- $state := .Values.state }}
{{- if not (include "ferry.databaseSecretName" .) }}
- {{ printf "--state-dir=%s" $state.stateDir | quote }}
{{- end }}
{{- with $state.apiKeysSecret.name }}
- {{ printf "--api-keys-file=%s" (include "ferry.apiKeysFile" $) | quote }}
{{- end }}
{{- include "ferry.flags" (dict "storeRetentionDays" $state.retentionDays "maxStoredBytesPerKey" $state.maxStoredBytesPerKey "maxFileBytes" $state.maxFileBytes "batchConcurrency" $state.batchConcurrency) }}
{{- end }}

{{/* Where the keys of state.apiKeysSecret are mounted. */}}
{{- define "ferry.apiKeysFile" -}}
/etc/ferry/api-keys/{{ .Values.state.apiKeysSecret.key }}
{{- end }}

{{/* The chart's PostgreSQL: its StatefulSet, Service and Secret share the name (52 characters at most: a
StatefulSet's pods get a controller-revision-hash label of its name and a hash). */}}
{{- define "ferry.postgresqlName" -}}
{{- printf "%s-postgresql" (include "ferry.fullname" .) | trunc 52 | trimSuffix "-" }}
{{- end }}

{{- define "ferry.postgresqlHost" -}}
{{- printf "%s.%s.svc" (include "ferry.postgresqlName" .) .Release.Namespace }}
{{- end }}

{{/* A name of their own, so that no selector of the model pods (Service, PDB, ServiceMonitor) matches them. */}}
{{- define "ferry.postgresqlSelectorLabels" -}}
app.kubernetes.io/name: {{ include "ferry.name" . }}-postgresql
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ferry.postgresqlLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "ferry.postgresqlSelectorLabels" . }}
app.kubernetes.io/component: database
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}
