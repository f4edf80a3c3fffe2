{{/*
Refuses value combinations that render valid objects but cannot work.
*/}}
{{- define "pagedinfer.validate" -}}
{{- if and .Values.example.enabled .Values.operator.watchNamespaces (not (has .Release.Namespace .Values.operator.watchNamespaces)) }}
{{- fail (printf "example.enabled installs an InferenceService in %q, which operator.watchNamespaces leaves out" .Release.Namespace) }}
{{- end }}
{{- range $key := list "inferencePool" "keda" }}
{{- $addon := index $.Values $key }}
{{- if and $addon.enabled (not $addon.inferenceService) (not $.Values.example.enabled) }}
{{- fail (printf "%s.enabled needs an InferenceService: set %s.inferenceService, or example.enabled" $key $key) }}
{{- end }}
{{- end }}
{{- if .Values.keda.enabled }}
{{- if gt (int .Values.keda.minReplicas) (int .Values.keda.maxReplicas) }}
{{- fail (printf "keda.minReplicas (%v) must not exceed keda.maxReplicas (%v)" .Values.keda.minReplicas .Values.keda.maxReplicas) }}
{{- end }}
{{- $target := default .Values.example.name .Values.keda.inferenceService }}
{{- if and .Values.example.enabled (eq $target .Values.example.name) .Values.example.spec.autoscaling }}
{{- fail "keda.enabled scales the example through its scale subresource: set example.spec.autoscaling to null and example.spec.replicas to a number" }}
{{- end }}
{{- end }}
{{- end }}
