{{- /* Names, labels and shared pieces of the detector's resources. */ -}}

{{- define "mcp-stream-exporter.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "mcp-stream-exporter.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "mcp-stream-exporter.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "mcp-stream-exporter.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "mcp-stream-exporter.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "mcp-stream-exporter.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mcp-stream-exporter.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "mcp-stream-exporter.labels" -}}
helm.sh/chart: {{ include "mcp-stream-exporter.chart" . }}
{{ include "mcp-stream-exporter.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: detector
app.kubernetes.io/part-of: mcp-stream-exporter
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "mcp-stream-exporter.ingestSecretName" -}}
{{- default (printf "%s-ingest" (include "mcp-stream-exporter.fullname" .)) .Values.ingestToken.existingSecret }}
{{- end }}

{{- /* http, or https with tls.secretName; the probes' scheme is its upper case. */ -}}
{{- define "mcp-stream-exporter.scheme" -}}
{{- ternary "https" "http" (not (empty .Values.tls.secretName)) }}
{{- end }}

{{- /*
A text (the alerts, a dashboard) whose runbook links' GitHub base is replaced by prometheusRule.runbookBaseUrl, the
base the detector's findings page links to as well (--runbook-base-url). Call with (list TEXT .Values).
*/ -}}
{{- define "mcp-stream-exporter.runbookLinks" -}}
{{- $text := index . 0 }}
{{- with (index . 1).prometheusRule.runbookBaseUrl }}
{{- $text = $text | replace "https://github.com/mcp-stream-exporter/mcp-stream-exporter/blob/main/docs/runbooks/" (printf "%s/" (trimSuffix "/" .)) }}
{{- end }}
{{- $text }}
{{- end }}

{{- /* The pod template of the Deployment and of the StatefulSet. */ -}}
{{- define "mcp-stream-exporter.podTemplate" -}}
metadata:
  labels:
    {{- include "mcp-stream-exporter.labels" . | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/policy: {{ toJson .Values.toolPolicy | sha256sum }}
    {{- if and .Values.ingestToken.enabled (not .Values.ingestToken.existingSecret) }}
    {{- /* the token is read from the Secret at start only: a new one rolls the pods */}}
    checksum/ingest-token: {{ include (print $.Template.BasePath "/secret.yaml") . | sha256sum }}
    {{- end }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  automountServiceAccountToken: false
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  terminationGracePeriodSeconds: 30
  containers:
    - name: detector
      image: "{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}"
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args:
        - serve
        - --host=0.0.0.0
        - --port={{ .Values.service.httpPort }}
        - --grpc-port={{ .Values.service.grpcPort }}
        - --otlp-http-port={{ .Values.service.otlpHttpPort }}
        - --clean-end-grace-s={{ .Values.detector.cleanEndGraceSeconds }}
        - --reissue-grace-s={{ .Values.detector.reissueGraceSeconds }}
        - --max-sessions={{ .Values.detector.maxSessions }}
        - --max-calls-per-session={{ .Values.detector.maxCallsPerSession }}
        - --session-ttl-s={{ .Values.detector.sessionTtlSeconds }}
        - --max-queued-spans={{ .Values.detector.maxQueuedSpans }}
        - --max-memory-mb={{ .Values.detector.maxMemoryMb }}
        - --log-level={{ .Values.detector.logLevel }}
        {{- with .Values.prometheusRule.runbookBaseUrl }}
        - {{ printf "--runbook-base-url=%s" . | quote }}
        {{- end }}
        {{- if .Values.toolPolicy }}
        - --policy=/etc/mcp-stream-exporter/policy.json
        {{- end }}
        {{- if .Values.tls.secretName }}
        - --tls-cert=/etc/mcp-stream-exporter-tls/tls.crt
        - --tls-key=/etc/mcp-stream-exporter-tls/tls.key
        {{- end }}
        {{- if .Values.snapshot.enabled }}
        - --snapshot-path=/var/lib/mcp-stream-exporter/ledger.db
        - --snapshot-interval-s={{ .Values.snapshot.intervalSeconds }}
        - --senders-retry-s={{ .Values.snapshot.sendersRetrySeconds }}
        {{- end }}
        {{- range .Values.detector.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      {{- if or .Values.ingestToken.enabled .Values.metricsAuth.existingSecret .Values.apiToken.existingSecret }}
      env:
        {{- if .Values.ingestToken.enabled }}
        - name: MCP_STREAM_INGEST_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ include "mcp-stream-exporter.ingestSecretName" . }}
              key: {{ .Values.ingestToken.secretKey }}
        {{- end }}
        {{- with .Values.metricsAuth.existingSecret }}
        - name: MCP_STREAM_METRICS_USER
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $.Values.metricsAuth.usernameKey }}
        - name: MCP_STREAM_METRICS_PASSWORD
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $.Values.metricsAuth.passwordKey }}
        {{- end }}
        {{- with .Values.apiToken.existingSecret }}
        - name: MCP_STREAM_API_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $.Values.apiToken.secretKey }}
        {{- end }}
      {{- end }}
      ports:
        - name: http
          containerPort: {{ .Values.service.httpPort }}
          protocol: TCP
        - name: otlp-grpc
          containerPort: {{ .Values.service.grpcPort }}
          protocol: TCP
        - name: otlp-http
          containerPort: {{ .Values.service.otlpHttpPort }}
          protocol: TCP
      startupProbe:
        httpGet:
          path: /healthz
          port: http
          scheme: {{ include "mcp-stream-exporter.scheme" . | upper }}
        periodSeconds: {{ .Values.probes.startup.periodSeconds }}
        failureThreshold: {{ .Values.probes.startup.failureThreshold }}
      livenessProbe:
        httpGet:
          path: /healthz
          port: http
          scheme: {{ include "mcp-stream-exporter.scheme" . | upper }}
        periodSeconds: 10
        timeoutSeconds: {{ .Values.probes.liveness.timeoutSeconds }}
      readinessProbe:
        httpGet:
          path: /readyz
          port: http
          scheme: {{ include "mcp-stream-exporter.scheme" . | upper }}
        periodSeconds: 5
      resources:
        {{- toYaml .Values.resources | nindent 8 }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        {{- if .Values.snapshot.enabled }}
        - name: data
          mountPath: /var/lib/mcp-stream-exporter
        {{- end }}
        {{- if .Values.toolPolicy }}
        - name: policy
          mountPath: /etc/mcp-stream-exporter
          readOnly: true
        {{- end }}
        {{- if .Values.tls.secretName }}
        - name: tls
          mountPath: /etc/mcp-stream-exporter-tls
          readOnly: true
        {{- end }}
  volumes:
    - name: tmp
      emptyDir: {}
    {{- if and .Values.snapshot.enabled (not (and .Values.statefulSet.enabled .Values.snapshot.persistentVolume.enabled)) }}
    - name: data
      emptyDir: {}
    {{- end }}
    {{- if .Values.toolPolicy }}
    - name: policy
      configMap:
        name: {{ include "mcp-stream-exporter.fullname" . }}-policy
    {{- end }}
    {{- with .Values.tls.secretName }}
    - name: tls
      secret:
        secretName: {{ . }}
        items:
          - {key: tls.crt, path: tls.crt}
          - {key: tls.key, path: tls.key}
    {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
Whether to render a prometheus-operator object whose value is "auto" (when the cluster serves the operator's API),
true (always: a `helm template` without --api-versions, a GitOps renderer; applying it needs the CRDs) or false.
Non-empty for yes. Call with (list .Values.<object>.enabled .Capabilities).
*/}}
{{- define "mcp-stream-exporter.operatorObject" -}}
{{- $enabled := toString (index . 0) -}}
{{- if or (eq $enabled "true") (and (eq $enabled "auto") ((index . 1).APIVersions.Has "monitoring.coreos.com/v1")) -}}
yes
{{- end -}}
{{- end }}

{{- /* A duration the values schema admits (minutes and seconds: 1m30s), in seconds. */}}
{{- define "mcp-stream-exporter.seconds" -}}
{{- $minutes := regexFind "[0-9]+m" . | trimSuffix "m" | default "0" | int -}}
{{- $seconds := regexFind "[0-9]+s" . | trimSuffix "s" | default "0" | int -}}
{{- add (mul $minutes 60) $seconds -}}
{{- end }}
