{{/* Names and labels. */}}
{{- define "otel-gpu.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "otel-gpu.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "otel-gpu.agentName" -}}
{{- printf "%s-agent" (include "otel-gpu.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "otel-gpu.aggregatorName" -}}
{{- printf "%s-aggregator" (include "otel-gpu.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "otel-gpu.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "otel-gpu.selectorLabels" -}}
app.kubernetes.io/name: {{ include "otel-gpu.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "otel-gpu.labels" -}}
helm.sh/chart: {{ include "otel-gpu.chart" . }}
{{ include "otel-gpu.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "otel-gpu.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "otel-gpu.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "otel-gpu.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* True when the agent reads /dev/kmsg, which needs a privileged container. */}}
{{- define "otel-gpu.agentKmsg" -}}
{{- if and .Values.agent.receivers.xid.enabled (eq .Values.agent.receivers.xid.source "kmsg") -}}true{{- end -}}
{{- end -}}

{{/* OTLP endpoint of the aggregator Service, as the agents' otlp exporter dials it. */}}
{{- define "otel-gpu.aggregatorEndpoint" -}}
{{- printf "%s.%s.svc:%d" (include "otel-gpu.aggregatorName" .) .Release.Namespace (int .Values.aggregator.ports.otlpGrpc) -}}
{{- end -}}

{{/* The aggregator link's security (aggregator.security): receiver settings for the aggregator's OTLP servers. */}}
{{- define "otel-gpu.aggregatorServerSecurity" -}}
{{- $sec := .Values.aggregator.security -}}
{{- $out := dict -}}
{{- if $sec.tlsSecret -}}
{{- $tls := dict "cert_file" "/var/run/secrets/otel-gpu/tls/tls.crt" "key_file" "/var/run/secrets/otel-gpu/tls/tls.key" -}}
{{- if $sec.mutualTls -}}{{- $_ := set $tls "client_ca_file" "/var/run/secrets/otel-gpu/tls/ca.crt" -}}{{- end -}}
{{- $_ := set $out "tls" $tls -}}
{{- end -}}
{{- if $sec.tokenSecret -}}
{{- $_ := set $out "auth" (dict "bearer_token_file" "/var/run/secrets/otel-gpu/token/token") -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* The agents' otlp/aggregator exporter, matching aggregator.security. */}}
{{- define "otel-gpu.aggregatorExporter" -}}
{{- $sec := .Values.aggregator.security -}}
{{- $out := dict "endpoint" (include "otel-gpu.aggregatorEndpoint" .) -}}
{{- if $sec.tlsSecret -}}
{{- $_ := set $out "endpoint" (printf "https://%s" (include "otel-gpu.aggregatorEndpoint" .)) -}}
{{- $tls := dict "ca_file" "/var/run/secrets/otel-gpu/tls/ca.crt" -}}
{{- if $sec.mutualTls -}}
{{- $_ := set $tls "cert_file" "/var/run/secrets/otel-gpu/tls/tls.crt" -}}
{{- $_ := set $tls "key_file" "/var/run/secrets/otel-gpu/tls/tls.key" -}}
{{- end -}}
{{- $_ := set $out "tls" $tls -}}
{{- end -}}
{{- if .Values.trustedForwarders.tokenSecret -}}
{{- /* The forwarder token also passes the aggregator's auth: the agents present it, so that what they forward keeps
the records that act (receivers.otlp.trusted_forwarders on the aggregator). */ -}}
{{- $_ := set $out "auth" (dict "bearer_token_file" "/var/run/secrets/otel-gpu/forwarder/token") -}}
{{- else if $sec.tokenSecret -}}
{{- $_ := set $out "auth" (dict "bearer_token_file" "/var/run/secrets/otel-gpu/token/token") -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* receivers.otlp.trusted_forwarders from trustedForwarders.tokenSecret; empty dict when unset. */}}
{{- define "otel-gpu.trustedForwarders" -}}
{{- if .Values.trustedForwarders.tokenSecret -}}
{{- toYaml (dict "trusted_forwarders" (dict "bearer_token_file" "/var/run/secrets/otel-gpu/forwarder/token")) -}}
{{- end -}}
{{- end -}}

{{/* The aggregator takes records from every node: without a token, any pod that reaches its Service can send. */}}
{{- define "otel-gpu.checkAggregatorToken" -}}
{{- $g := .Values.aggregator -}}
{{- if and $g.enabled (not $g.security.tokenSecret) (not $g.security.mutualTls) (not $g.security.allowUnauthenticated) -}}
{{- fail "aggregator.enabled needs aggregator.security.tokenSecret (a Secret with key `token`; the agents send it) or aggregator.security.mutualTls: without either, any pod that reaches the aggregator's Service can send it telemetry. Set aggregator.security.allowUnauthenticated=true to install anyway (NOTES.txt then warns)" -}}
{{- end -}}
{{- if and $g.enabled $g.verdict.enabled -}}
{{- if and (not $g.verdict.tokenSecret) (not $g.security.allowUnauthenticated) -}}
{{- fail "aggregator.verdict.enabled needs aggregator.verdict.tokenSecret (a Secret with key `token`; each node's otel-gpu run reads it from OTEL_GPU_VERDICT_TOKEN_FILE): the API serves every job's verdicts and takes the jobs' restart decisions. Set aggregator.security.allowUnauthenticated=true to install anyway (reads open to the cluster, decisions only from the aggregator's own host)" -}}
{{- end -}}
{{- if gt (int $g.replicas) 1 -}}
{{- fail "aggregator.verdict.enabled needs aggregator.replicas: 1 (the jobs' board lives in one aggregator's memory; shard jobs over several releases or a load-balancing collector instead, docs/scale.md)" -}}
{{- end -}}
{{- end -}}
{{- $t := .Values.trainingEnv -}}
{{- range $k, $v := $t.extra | default dict -}}
{{- if or (contains "TOKEN" (upper $k)) (and (eq (upper $k) "OTEL_EXPORTER_OTLP_HEADERS") (contains "bearer" (lower (toString $v)))) -}}
{{- fail (printf "trainingEnv.extra.%s: a ConfigMap is no place for a secret, and the training job's environment is no place for the verdict or forwarder token; give training pods the agent's token with env.valueFrom.secretKeyRef (agent.security.tokenSecret, see NOTES.txt)" $k) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* memory_limiter settings (memoryLimiter values); empty when off. */}}
{{- define "otel-gpu.memoryLimiter" -}}
{{- $m := .Values.memoryLimiter -}}
{{- if $m.enabled -}}
{{- toYaml (dict "memory_limiter" (dict "check_interval" "1s" "limit_percentage" (int $m.limitPercentage) "spike_limit_percentage" (int $m.spikeLimitPercentage))) -}}
{{- end -}}
{{- end -}}

{{/*
The processors of every pipeline, in order: memory_limiter first (it must see data before anything else holds it),
then attribution and goodput where this collector analyzes (`analyze`), then the extraProcessors list. Returns
{chain: [names], settings: {name: settings}}. Called with (dict "Values" .Values "analyze" BOOL "extra" LIST).
*/}}
{{- define "otel-gpu.processors" -}}
{{- $settings := include "otel-gpu.memoryLimiter" . | fromYaml | default dict -}}
{{- $chain := list -}}
{{- if $settings -}}{{- $chain = append $chain "memory_limiter" -}}{{- end -}}
{{- if .analyze -}}
{{- range $name := list "attribution" "goodput" -}}
{{- $p := index $.Values $name -}}
{{- if $p.enabled -}}
{{- $_ := set $settings $name (deepCopy ($p.settings | default dict)) -}}
{{- $chain = append $chain $name -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $p := .extra | default list -}}
{{- if has $p.name $chain -}}{{- fail (printf "extraProcessors: %s is already in every pipeline (set its settings through attribution/goodput/memoryLimiter or *.config)" $p.name) -}}{{- end -}}
{{- $_ := set $settings $p.name (deepCopy ($p.settings | default dict)) -}}
{{- $chain = append $chain $p.name -}}
{{- end -}}
{{- toYaml (dict "chain" $chain "settings" $settings) -}}
{{- end -}}

{{/* Exporter settings for the OTLP backend (empty dict when none). */}}
{{- define "otel-gpu.backendExporter" -}}
{{- $b := .Values.backend.otlp -}}
{{- toYaml (mustMergeOverwrite (dict "endpoint" $b.endpoint) (deepCopy ($b.settings | default dict))) -}}
{{- end -}}

{{/*
The node agent's collector config (our YAML, in the OpenTelemetry Collector's shape), built from values and then
overlaid with .Values.agent.config.
*/}}
{{- define "otel-gpu.agentConfig" -}}
{{- $a := .Values.agent -}}
{{- $r := $a.receivers -}}
{{- $otlpSec := dict -}}
{{- if $a.security.tokenSecret -}}
{{- $_ := set $otlpSec "auth" (dict "bearer_token_file" "/var/run/secrets/otel-gpu/agent-token/token") -}}
{{- end -}}
{{- $otlp := dict "grpc" (mustMergeOverwrite (dict "endpoint" (printf "0.0.0.0:%d" (int $a.ports.otlpGrpc))) (deepCopy $otlpSec)) "http" (mustMergeOverwrite (dict "endpoint" (printf "0.0.0.0:%d" (int $a.ports.otlpHttp))) (deepCopy $otlpSec)) -}}
{{- $otlp = mustMergeOverwrite $otlp (include "otel-gpu.trustedForwarders" . | fromYaml | default dict) -}}
{{- $receivers := dict "otlp" $otlp -}}
{{- $metricsIn := list "otlp" -}}
{{- $logsIn := list "otlp" -}}
{{- if $r.nvml.enabled -}}
{{- /* Receivers name the node, not the pod: host.name from the downward API (NODE_NAME). */ -}}
{{- $_ := set $receivers "nvml" (mustMergeOverwrite (dict "host_name" "${env:NODE_NAME}") (deepCopy ($r.nvml.settings | default dict))) -}}
{{- $metricsIn = append $metricsIn "nvml" -}}
{{- $logsIn = append $logsIn "nvml" -}}
{{- end -}}
{{- if $r.nic.enabled -}}
{{- $_ := set $receivers "nic" (mustMergeOverwrite (dict "sysfs_root" "/host/sys" "host_name" "${env:NODE_NAME}") (deepCopy ($r.nic.settings | default dict))) -}}
{{- $metricsIn = append $metricsIn "nic" -}}
{{- end -}}
{{- if $r.xid.enabled -}}
{{- $xid := dict -}}
{{- if eq $r.xid.source "file" -}}
{{- $xid = dict "path" (printf "/host/kernlog/%s" (base $r.xid.file.path)) -}}
{{- else -}}
{{- $xid = dict "path" "/dev/kmsg" -}}
{{- end -}}
{{- $_ := set $xid "host_name" "${env:NODE_NAME}" -}}
{{- $_ := set $receivers "xid" (mustMergeOverwrite $xid (deepCopy ($r.xid.settings | default dict))) -}}
{{- $logsIn = append $logsIn "xid" -}}
{{- end -}}
{{- $exporters := dict "prometheus" (dict "endpoint" (printf "0.0.0.0:%d" (int $a.ports.metrics))) "store" (dict "path" "/var/lib/otel-gpu") -}}
{{- $traceOut := list "store" -}}
{{- $metricsOut := list "prometheus" "store" -}}
{{- $logsOut := list "store" -}}
{{- /* With an aggregator, traces reach the backend through it, so that the failure.* attributes it adds to the
spans are on the spans the backend stores (and nothing is sent twice). */ -}}
{{- if and .Values.backend.otlp.endpoint (not .Values.aggregator.enabled) -}}
{{- $_ := set $exporters "otlp/backend" (include "otel-gpu.backendExporter" . | fromYaml) -}}
{{- $traceOut = append $traceOut "otlp/backend" -}}
{{- end -}}
{{- if .Values.aggregator.enabled -}}
{{- $_ := set $exporters "otlp/aggregator" (include "otel-gpu.aggregatorExporter" . | fromYaml) -}}
{{- $traceOut = append $traceOut "otlp/aggregator" -}}
{{- $metricsOut = append $metricsOut "otlp/aggregator" -}}
{{- $logsOut = append $logsOut "otlp/aggregator" -}}
{{- end -}}
{{- $pipelines := dict "traces" (dict "receivers" (list "otlp") "exporters" $traceOut) "metrics" (dict "receivers" $metricsIn "exporters" $metricsOut) "logs" (dict "receivers" $logsIn "exporters" $logsOut) -}}
{{- /* Attribution and goodput run here unless the aggregator does (it sees every node of a job). */ -}}
{{- $processors := include "otel-gpu.processors" (dict "Values" .Values "analyze" (not .Values.aggregator.enabled) "extra" $a.extraProcessors) | fromYaml -}}
{{- range $name, $p := $pipelines -}}{{- if $processors.chain -}}{{- $_ := set $p "processors" $processors.chain -}}{{- end -}}{{- end -}}
{{- $config := dict "receivers" $receivers "processors" $processors.settings "exporters" $exporters "service" (dict "pipelines" $pipelines) -}}
{{- toYaml (mustMergeOverwrite $config (deepCopy ($a.config | default dict))) -}}
{{- end -}}

{{/* The aggregator's collector config, overlaid with .Values.aggregator.config. */}}
{{- define "otel-gpu.aggregatorConfig" -}}
{{- $g := .Values.aggregator -}}
{{- $sec := include "otel-gpu.aggregatorServerSecurity" . | fromYaml | default dict -}}
{{- $otlp := dict "grpc" (mustMergeOverwrite (dict "endpoint" (printf "0.0.0.0:%d" (int $g.ports.otlpGrpc))) (deepCopy $sec)) "http" (mustMergeOverwrite (dict "endpoint" (printf "0.0.0.0:%d" (int $g.ports.otlpHttp))) (deepCopy $sec)) -}}
{{- $otlp = mustMergeOverwrite $otlp (include "otel-gpu.trustedForwarders" . | fromYaml | default dict) -}}
{{- $receivers := dict "otlp" $otlp -}}
{{- $exporters := dict "prometheus" (dict "endpoint" (printf "0.0.0.0:%d" (int $g.ports.metrics))) "store" (dict "path" "/var/lib/otel-gpu") -}}
{{- $traceOut := list "store" -}}
{{- if .Values.backend.otlp.endpoint -}}
{{- $_ := set $exporters "otlp/backend" (include "otel-gpu.backendExporter" . | fromYaml) -}}
{{- $traceOut = append $traceOut "otlp/backend" -}}
{{- end -}}
{{- $logsOut := list "store" -}}
{{- if $g.verdict.enabled -}}
{{- $verdict := dict "endpoint" (printf "0.0.0.0:%d" (int $g.verdict.port)) -}}
{{- if $g.verdict.tokenSecret -}}{{- $_ := set $verdict "auth" (dict "bearer_token_file" "/var/run/secrets/otel-gpu/verdict/token") -}}{{- end -}}
{{- if $g.security.tlsSecret -}}{{- $_ := set $verdict "tls" (dict "cert_file" "/var/run/secrets/otel-gpu/tls/tls.crt" "key_file" "/var/run/secrets/otel-gpu/tls/tls.key") -}}{{- end -}}
{{- $_ := set $exporters "verdict" $verdict -}}
{{- $logsOut = append $logsOut "verdict" -}}
{{- end -}}
{{- $pipelines := dict "traces" (dict "receivers" (list "otlp") "exporters" $traceOut) "metrics" (dict "receivers" (list "otlp") "exporters" (list "prometheus" "store")) "logs" (dict "receivers" (list "otlp") "exporters" $logsOut) -}}
{{- $processors := include "otel-gpu.processors" (dict "Values" .Values "analyze" true "extra" $g.extraProcessors) | fromYaml -}}
{{- range $name, $p := $pipelines -}}{{- if $processors.chain -}}{{- $_ := set $p "processors" $processors.chain -}}{{- end -}}{{- end -}}
{{- if $g.verdict.enabled -}}
{{- /* health: drained devices for the devices API, in the pipelines that carry device metrics and events. */ -}}
{{- $_ := set $processors.settings "health" dict -}}
{{- range $name := list "metrics" "logs" -}}{{- $p := index $pipelines $name -}}{{- $_ := set $p "processors" (append ($p.processors | default list) "health") -}}{{- end -}}
{{- end -}}
{{- $config := dict "receivers" $receivers "processors" $processors.settings "exporters" $exporters "service" (dict "pipelines" $pipelines) -}}
{{- toYaml (mustMergeOverwrite $config (deepCopy ($g.config | default dict))) -}}
{{- end -}}

{{/* Downward-API environment shared by agent and aggregator: the node's name, which the receivers' host_name reads
(${env:NODE_NAME}). Only variables the collector reads are set (tests/test_helm.py checks each). */}}
{{- define "otel-gpu.downwardEnv" -}}
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- end -}}
