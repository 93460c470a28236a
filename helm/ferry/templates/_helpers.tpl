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
default applies), true/false become --flag/--no-flag, anything else --flag=value. Whole numbers are
printed as integers: Helm reads every YAML number as a float, and 10485760 would otherwise print as
1.048576e+07.
*/}}
{{- define "ferry.flags" -}}
{{- range $key, $value := . }}
{{- $flag := kebabcase $key }}
{{- if kindIs "invalid" $value }}
{{- else if kindIs "bool" $value }}
- {{ printf "--%s%s" (ternary "" "no-" $value) $flag | quote }}
{{- else if and (kindIs "float64" $value) (eq $value (floor $value)) }}
- {{ printf "--%s=%d" $flag (int64 $value) | quote }}
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
