{{- define "kvserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "kvserve.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "kvserve.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvserve.labels" -}}
{{ include "kvserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
What the operator does in a namespace it serves (kvserve.operator.kube / handlers / leader):
reconcile InferenceServices and their children, read pod statuses and the API-key Secret, post Events.
One definition for both scopes: a ClusterRole (all namespaces) or a Role per operator.watchNamespaces entry.
*/}}
{{- define "kvserve.workloadRules" -}}
# The InferenceService: watched, annotated by kopf (progress/diff-base), status written by the operator.
- apiGroups: [serving.kvserve.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.kvserve.dev]
  resources: [inferenceservices/status]
  verbs: [get, patch]
# Children carry ownerReferences with blockOwnerDeletion: clusters that enforce OwnerReferencesPermission-
# Enforcement require update on the owner's finalizers subresource to set them (KServe #2838).
- apiGroups: [serving.kvserve.dev]
  resources: [inferenceservices/finalizers]
  verbs: [update]
# Children: created, compared, repaired and pruned.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
# spec.autoscaling.minReplicas 0: a KEDA ScaledObject instead of the HPA; spec.gateway.inferencePool: a GIE
# InferencePool. Both from optional CRDs (RBAC may name resources a cluster does not serve).
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, watch, create, patch, delete]
# Replicas larger than one node: a LeaderWorkerSet (optional CRD, github.com/kubernetes-sigs/lws).
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, delete]
# spec.router: the router's ServiceAccount, Role and RoleBinding. RBAC lets the operator grant only what
# it holds itself, hence read access to EndpointSlices (the router's Role).
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
# Pod statuses (CrashLoopBackOff, OOMKilled, Unschedulable, ...) become the Degraded condition. Read only.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list]
# The API-key Secret named in spec.auth.apiKeySecretRef, for its rotation digest, and the model credentials
# in spec.model.credentials.secretRef, to fetch a non-catalog model's config.json. The operator cannot list,
# watch, patch or delete Secrets, so it can read one only by a name some InferenceService gives; it creates
# one: a multi-node replica's group key (<name>-multinode, random, garbage-collected with its owner).
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
# Warning Events (capacity failures, pod failures, child conflicts).
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create]
{{- end -}}
