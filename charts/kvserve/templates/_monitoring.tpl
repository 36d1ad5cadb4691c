{{- /* Helpers for the monitoring templates (PodMonitor, ServiceMonitor, PrometheusRule, dashboard). */ -}}

{{- define "kvserve.monitoringLabels" -}}
{{ include "kvserve.labels" . }}
{{- with .Values.monitoring.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- /* Labels of one alert: (list $ "critical") */ -}}
{{- define "kvserve.alertLabels" -}}
{{- $root := index . 0 -}}
severity: {{ index . 1 }}
{{- with $root.Values.monitoring.prometheusRule.additionalRuleLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- /* runbook_url of one alert: (list $ "KvserveSomething") -> <base>#kvservesomething (the docs heading's anchor) */ -}}
{{- define "kvserve.runbook" -}}
{{- printf "%s#%s" (index . 0).Values.monitoring.prometheusRule.runbookBaseUrl (lower (index . 1)) -}}
{{- end -}}
