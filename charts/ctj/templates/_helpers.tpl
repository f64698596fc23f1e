{{/* Names and labels: one definition each, used by every template. */}}

{{- define "ctj.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name: <release>-<chart>, or <release> when it already contains the chart name,
truncated to 63 characters (the DNS label limit some names are held to).
*/}}
{{- define "ctj.fullname" -}}
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

{{- define "ctj.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: stable across upgrades (a Deployment's selector is immutable). */}}
{{- define "ctj.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ctj.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "ctj.labels" -}}
helm.sh/chart: {{ include "ctj.chart" . }}
{{ include "ctj.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ctj
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "ctj.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ctj.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ctj.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "ctj.sidecarImage" -}}
{{- printf "%s:%s" .Values.sidecarImage.repository (default .Chart.AppVersion .Values.sidecarImage.tag) }}
{{- end }}

{{/*
The pod's affinity: .Values.affinity, plus anti-affinity between the operator's own
replicas by hostname (podAntiAffinity: preferred or required) unless affinity sets its
own. One node's loss then leaves a standby elsewhere to take the leader Lease.
*/}}
{{- define "ctj.affinity" -}}
{{- $affinity := deepCopy .Values.affinity }}
{{- if and (ne .Values.podAntiAffinity "none") (not (hasKey $affinity "podAntiAffinity")) }}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (include "ctj.selectorLabels" . | fromYaml)) }}
{{- if eq .Values.podAntiAffinity "required" }}
{{- $_ := set $affinity "podAntiAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (list $term)) }}
{{- else }}
{{- $_ := set $affinity "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" $term))) }}
{{- end }}
{{- end }}
{{- with $affinity }}
{{- toYaml . }}
{{- end }}
{{- end }}
