{{/*
Refuses value combinations that render valid objects but cannot work.
*/}}
{{- define "pagedinfer.validate" -}}
{{- if and .Values.example.enabled .Values.operator.watchNamespaces (not (has .Release.Namespace .Values.operator.watchNamespaces)) }}
{{- fail (printf "example.enabled installs an InferenceService in %q, which operator.watchNamespaces leaves out" .Release.Namespace) }}
{{- end }}
{{- end }}
