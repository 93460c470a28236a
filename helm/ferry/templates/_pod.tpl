{{/*
The ferry pod template (metadata and spec), for one of three roles:
  server  a pod of the Deployment: serves HTTP, runs every rank of its model;
  leader  a LeaderWorkerSet group's first pod: serves HTTP, runs node 0's ranks;
  worker  the group's other pods: run their node's ranks, no HTTP. A worker has no probes: it lives exactly as
          long as its ranks, which leave when the leader stops them or when the group's collectives fail (then
          the container exits and the LeaderWorkerSet recreates the whole group). It ignores SIGTERM and keeps
          its ranks up while the leader drains, so it gets the leader's grace period.
Called as (include "ferry.podTemplate" (dict "root" $ "role" "server")).
*/}}
{{- define "ferry.podTemplate" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $values := $root.Values }}
{{- $storage := $values.modelStorage }}
{{- $modelVolume := ne $storage.type "none" }}
{{- $serverFlags := omit $values.server "model" "port" "apiKey" }}
{{- $serves := ne $role "worker" }}
metadata:
  labels:
    {{- include "ferry.selectorLabels" $root | nindent 4 }}
    {{- if ne $role "server" }}
    app.kubernetes.io/component: {{ $role }}
    {{- end }}
    {{- with $values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- if or $values.server.apiKey.value (and $values.metrics.podAnnotations $serves) $values.podAnnotations }}
  annotations:
    {{- if $values.server.apiKey.value }}
    # Roll the pods when the chart-managed API key changes.
    checksum/api-key: {{ $values.server.apiKey.value | sha256sum }}
    {{- end }}
    {{- if and $values.metrics.podAnnotations $serves }}
    prometheus.io/scrape: "true"
    prometheus.io/port: {{ $values.server.port | quote }}
    prometheus.io/path: /metrics
    {{- end }}
    {{- with $values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
spec:
  {{- with $values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.serviceAccountName }}
  serviceAccountName: {{ . }}
  {{- end }}
  {{- with $values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  securityContext:
    {{- toYaml $values.podSecurityContext | nindent 4 }}
  terminationGracePeriodSeconds: {{ include "ferry.terminationGracePeriodSeconds" $root }}
  {{- with $storage.initContainers }}
  initContainers:
    {{- range . }}
    - name: {{ .name }}
      {{- toYaml (omit . "name" "volumeMounts") | nindent 6 }}
      volumeMounts:
        - name: models
          mountPath: {{ $storage.mountPath }}
        {{- with .volumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    {{- end }}
  {{- end }}
  containers:
    - name: ferry
      image: {{ include "ferry.image" $root | quote }}
      imagePullPolicy: {{ $values.image.pullPolicy }}
      # Appended to the image's ENTRYPOINT (ferry serve --host 0.0.0.0 --port 8000).
      args:
        {{- with $values.server.model }}
        - {{ printf "--model=%s" . | quote }}
        {{- end }}
        - {{ printf "--port=%d" (int64 $values.server.port) | quote }}
        {{- with include "ferry.flags" $serverFlags | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with include "ferry.flags" $values.engine | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with include "ferry.tensorParallelArgs" $root | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- range $values.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      {{- if or (include "ferry.apiKeyEnabled" $root) $values.extraEnv }}
      env:
        {{- if include "ferry.apiKeyEnabled" $root }}
        - name: FERRY_API_KEY
          valueFrom:
            secretKeyRef:
              name: {{ include "ferry.apiKeySecretName" $root }}
              key: {{ $values.server.apiKey.secretKey }}
        {{- end }}
        {{- with $values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
      {{- if $serves }}
      ports:
        - name: http
          containerPort: {{ $values.server.port }}
          protocol: TCP
        {{- if eq $role "leader" }}
        # Where the group's ranks meet (torch.distributed's store); the ranks then connect to each other directly.
        - name: rendezvous
          containerPort: {{ $values.tensorParallel.masterPort }}
          protocol: TCP
        {{- end }}
      startupProbe:
        {{- toYaml $values.startupProbe | nindent 8 }}
      readinessProbe:
        {{- toYaml $values.readinessProbe | nindent 8 }}
      livenessProbe:
        {{- toYaml $values.livenessProbe | nindent 8 }}
      lifecycle:
        preStop:
          # Keep serving while endpoints and ingresses drop this pod; ferry drains after SIGTERM.
          exec:
            command: ["sleep", {{ $values.termination.preStopSleepSeconds | int64 | quote }}]
      {{- end }}
      resources:
        {{- $resources := deepCopy $values.resources }}
        {{- if gt (int64 $values.gpu.count) 0 }}
        {{- $limits := default (dict) $resources.limits }}
        {{- $_ := set $limits $values.gpu.resourceName (int64 $values.gpu.count) }}
        {{- $_ := set $resources "limits" $limits }}
        {{- end }}
        {{- toYaml $resources | nindent 8 }}
      securityContext:
        {{- toYaml $values.securityContext | nindent 8 }}
      {{- if or $modelVolume $values.shm.enabled $values.extraVolumeMounts }}
      volumeMounts:
        {{- if $modelVolume }}
        - name: models
          mountPath: {{ $storage.mountPath }}
          readOnly: true
        {{- end }}
        {{- if $values.shm.enabled }}
        - name: dshm
          mountPath: /dev/shm
        {{- end }}
        {{- with $values.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
  {{- if or $modelVolume $values.shm.enabled $values.extraVolumes }}
  volumes:
    {{- if eq $storage.type "pvc" }}
    - name: models
      persistentVolumeClaim:
        claimName: {{ default (printf "%s-models" (include "ferry.fullname" $root)) $storage.pvc.existingClaim }}
    {{- else if eq $storage.type "hostPath" }}
    - name: models
      hostPath:
        path: {{ $storage.hostPath.path }}
        type: {{ $storage.hostPath.type }}
    {{- else if eq $storage.type "emptyDir" }}
    - name: models
      emptyDir:
        sizeLimit: {{ $storage.emptyDir.sizeLimit }}
    {{- end }}
    {{- if $values.shm.enabled }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $values.shm.sizeLimit }}
    {{- end }}
    {{- with $values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
  {{- with $values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
