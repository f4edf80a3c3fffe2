{{/*
Names and labels shared by every template, after `helm create`'s skeleton.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "pagedinfer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every resource name: fullnameOverride, else <release>-<name>, or just the
release name when it already contains the chart name. 63 characters at most (DNS label).
*/}}
{{- define "pagedinfer.fullname" -}}
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

{{/* The name of the operator's Deployment, ServiceAccount and RBAC objects. */}}
{{- define "pagedinfer.operatorName" -}}
{{- printf "%s-operator" (include "pagedinfer.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* chart-version, for the helm.sh/chart label. */}}
{{- define "pagedinfer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The standard app.kubernetes.io labels on every object of the release. */}}
{{- define "pagedinfer.labels" -}}
helm.sh/chart: {{ include "pagedinfer.chart" . }}
{{ include "pagedinfer.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pagedinfer
{{- end }}

{{/* Labels that select the release's pods; never change them on upgrade. */}}
{{- define "pagedinfer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedinfer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Selector labels of the operator's pods. */}}
{{- define "pagedinfer.operatorSelectorLabels" -}}
{{ include "pagedinfer.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The operator's ServiceAccount: created, named, or the namespace's default. */}}
{{- define "pagedinfer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pagedinfer.operatorName" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The image reference; the tag defaults to the chart's appVersion. */}}
{{- define "pagedinfer.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The namespaces the operator watches: operator.watchNamespaces, or an empty list for
all namespaces (cluster-wide RBAC).
*/}}
{{- define "pagedinfer.clusterWide" -}}
{{- if not .Values.operator.watchNamespaces }}true{{- end }}
{{- end }}

{{/*
The endpoint picker's configuration for pagedinfer pods: the metric names they export
(vLLM's) for the engine type the operator labels them with, and the scorers that read
them. The same as in examples/inferencepool.yaml; with
inferencePool.precisePrefixCache.enabled, prefix-cache scoring on the pods' KV-cache
events, as in examples/inferencepool-precise-prefix.yaml.
*/}}
{{- define "pagedinfer.eppConfig" -}}
{{- $precise := .Values.inferencePool.precisePrefixCache -}}
{{- $pool := default .Values.example.name .Values.inferencePool.inferenceService -}}
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
{{- if $precise.enabled }}
  # Token ids from the pods' own tokenizer (vLLM's render endpoints on their Service).
  - type: token-producer
    parameters:
      modelName: {{ $precise.modelName | default .Values.example.spec.model.name | required "inferencePool.precisePrefixCache.modelName (or example.spec.model.name) is required" | quote }}
      vllm:
        url: {{ printf "http://%s:%v" $pool ((.Values.example.spec.service | default dict).httpPort | default 8000) | quote }}
  # Subscribes to tcp://<pod IP>:<port> of every pod of the pool and indexes their blocks.
  - type: precise-prefix-cache-producer
    parameters:
      tokenProcessorConfig:
        blockSizeTokens: 16
      kvEventsConfig:
        topicFilter: "kv@"
        concurrency: 4
        discoverPods: true
        podDiscoveryConfig:
          socketPort: {{ $precise.port }}
  - type: prefix-cache-scorer
    parameters:
      prefixMatchInfoProducerName: precise-prefix-cache-producer
  - type: endpoint-notification-source
  - type: metrics-data-source
    parameters:
      scheme: http
      path: /metrics
  - type: core-metrics-extractor
    parameters:
      # The operator labels the pods llm-d.ai/engine-type=pagedinfer.
      defaultEngine: pagedinfer
      engineConfigs:
        - name: pagedinfer
          queuedRequestsSpec: vllm:num_requests_waiting
          runningRequestsSpec: vllm:num_requests_running
          kvUsageSpec: vllm:kv_cache_usage_perc
          loraSpec: ""  # pagedinfer serves no LoRA adapters
          cacheInfoSpec: vllm:cache_config_info
  - type: queue-scorer
  - type: kv-cache-utilization-scorer
dataLayer:
  sources:
    - pluginRef: metrics-data-source
      extractors:
        - pluginRef: core-metrics-extractor
    - pluginRef: endpoint-notification-source
      extractors:
        - pluginRef: precise-prefix-cache-producer
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: prefix-cache-scorer
        weight: 3
      - pluginRef: queue-scorer
        weight: 2
      - pluginRef: kv-cache-utilization-scorer
        weight: 2
{{- else }}
  - type: metrics-data-source
    parameters:
      scheme: http
      path: /metrics
  - type: core-metrics-extractor
    parameters:
      # The operator labels the pods llm-d.ai/engine-type=pagedinfer.
      defaultEngine: pagedinfer
      engineConfigs:
        - name: pagedinfer
          queuedRequestsSpec: vllm:num_requests_waiting
          runningRequestsSpec: vllm:num_requests_running
          kvUsageSpec: vllm:kv_cache_usage_perc
          loraSpec: ""  # pagedinfer serves no LoRA adapters
          cacheInfoSpec: vllm:cache_config_info
  - type: queue-scorer
  - type: kv-cache-utilization-scorer
  - type: prefix-cache-scorer
dataLayer:
  sources:
    - pluginRef: metrics-data-source
      extractors:
        - pluginRef: core-metrics-extractor
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: queue-scorer
        weight: 2
      - pluginRef: kv-cache-utilization-scorer
        weight: 2
      - pluginRef: prefix-cache-scorer
        weight: 3
{{- end }}
{{- end }}
