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
{{- /* Stored state is the serving pods' only: a worker runs its ranks, no HTTP and no database. */}}
{{- $database := include "ferry.databaseSecretName" $root }}
{{- $state := $values.state }}
{{- $stateVolume := and $serves (not $database) }}
{{- $apiKeys := and $serves $state.apiKeysSecret.name }}
{{- $waitForDatabase := and $serves $values.postgresql.enabled }}
metadata:
  labels:
    {{- include "ferry.selectorLabels" $root | nindent 4 }}
    {{- if ne $role "server" }}
    app.kubernetes.io/component: {{ $role }}
    {{- end }}
    {{- with $values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- $databaseUrlValue := and $serves $database $state.databaseUrl.value (not $state.databaseUrl.existingSecret) }}
  {{- if or $values.server.apiKey.value $databaseUrlValue (and $values.metrics.podAnnotations $serves) $values.podAnnotations }}
  annotations:
    {{- if $values.server.apiKey.value }}
    # Roll the pods when the chart-managed API key changes.
    checksum/api-key: {{ $values.server.apiKey.value | sha256sum }}
    {{- end }}
    {{- if $databaseUrlValue }}
    checksum/database-url: {{ $state.databaseUrl.value | sha256sum }}
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
  {{- if or $storage.initContainers $waitForDatabase }}
  initContainers:
    {{- if $waitForDatabase }}
    # The server opens its database first thing at start-up and exits if it cannot: wait for the chart's
    # PostgreSQL to take connections (its headless Service resolves once the pod is ready).
    - name: wait-for-postgresql
      image: {{ include "ferry.image" $root | quote }}
      imagePullPolicy: {{ $values.image.pullPolicy }}
      command:
        - python
        - -c
        - |
          import socket, sys, time
          while True:
              try:
                  socket.create_connection((sys.argv[1], 5432), timeout=5).close()
                  break
              except OSError as error:
                  print(f"waiting for {sys.argv[1]}:5432: {error}", flush=True)
                  time.sleep(2)
        - {{ include "ferry.postgresqlHost" $root | quote }}
      resources:
        requests:
          cpu: 10m
          memory: 32Mi
        limits:
          memory: 128Mi
      securityContext:
        {{- toYaml $values.securityContext | nindent 8 }}
    {{- end }}
    {{- range $storage.initContainers }}
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
        {{- if $serves }}
        {{- with include "ferry.stateArgs" $root | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- end }}
        {{- range $values.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      {{- if or (include "ferry.apiKeyEnabled" $root) (and $serves $database) $values.extraEnv }}
      env:
        {{- if include "ferry.apiKeyEnabled" $root }}
        - name: FERRY_API_KEY
          valueFrom:
            secretKeyRef:
              name: {{ include "ferry.apiKeySecretName" $root }}
              key: {{ $values.server.apiKey.secretKey }}
        {{- end }}
        {{- if and $serves $database }}
        # The stored-state database (--database-url's fallback): the password stays out of the pod spec and `ps`.
        - name: FERRY_DATABASE_URL
          valueFrom:
            secretKeyRef:
              name: {{ $database }}
              key: {{ include "ferry.databaseSecretKey" $root }}
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
      {{- if or $modelVolume $values.shm.enabled $stateVolume $apiKeys $values.extraVolumeMounts }}
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
        {{- if $stateVolume }}
        - name: state
          mountPath: {{ $state.stateDir }}
        {{- end }}
        {{- if $apiKeys }}
        - name: api-keys
          mountPath: {{ dir (include "ferry.apiKeysFile" $root) }}
          readOnly: true
        {{- end }}
        {{- with $values.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
  {{- if or $modelVolume $values.shm.enabled $stateVolume $apiKeys $values.extraVolumes }}
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
    {{- if $stateVolume }}
    # The SQLite database of stored state (one replica: several would each keep their own).
    - name: state
      {{- if $state.persistence.enabled }}
      persistentVolumeClaim:
        claimName: {{ default (printf "%s-state" (include "ferry.fullname" $root)) $state.persistence.existingClaim }}
      {{- else }}
      emptyDir: {}
      {{- end }}
    {{- end }}
    {{- if $apiKeys }}
    - name: api-keys
      secret:
        secretName: {{ $state.apiKeysSecret.name }}
        items:
          - key: {{ $state.apiKeysSecret.key }}
            path: {{ $state.apiKeysSecret.key }}
        defaultMode: 0440
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
