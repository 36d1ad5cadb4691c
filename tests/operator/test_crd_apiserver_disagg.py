"""spec.disaggregation against the real API server (tests/operator/apiserver.py): a disaggregated
InferenceService whose pools span nodes is admitted and defaulted as the operator resolves it, and the two
LeaderWorkerSets `kvserve render` makes of it are created (not dry-run) against the upstream LWS CRD, as the
aggregated multi-node ones are in test_crd_apiserver.py. The table of valid/invalid spec.disaggregation rows
(server and operator agree) is in test_crd_apiserver.py's TABLE."""

from __future__ import annotations

import copy

import pytest

from kvserve.cli.render import render_documents
from kvserve.operator import spec as spec_mod
from kvserve.operator.render import disaggregation as render_pd
from tests.operator import upstream_crds
from tests.operator.apiserver import ApiServer
from tests.operator.conftest import NAMESPACE as NS
from tests.operator.conftest import create
from tests.operator.test_render_disagg import PD_405B

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def upstream(crd_server: ApiServer) -> ApiServer:
    for crd in upstream_crds.crds():
        crd_server.apply_crd(crd)
    return crd_server


def test_leader_worker_set_pools_are_created_against_the_upstream_crd(upstream):
    doc = {
        "apiVersion": spec_mod.API_VERSION,
        "kind": spec_mod.KIND,
        "metadata": {"name": "pd405", "namespace": NS},
        "spec": copy.deepcopy(PD_405B),
    }
    stored = create(upstream, copy.deepcopy(doc), spec_mod.PLURAL)
    assert stored["spec"]["disaggregation"] == PD_405B["disaggregation"]  # no defaults under it: the operator's
    objs, errors, _ = render_documents([doc], NS)
    assert not errors, errors
    made = []
    for obj in objs:
        if obj["kind"] == "LeaderWorkerSet":
            live = create(upstream, obj, upstream_crds.plural(obj["apiVersion"], obj["kind"]), dry_run=False)
            assert live["metadata"]["uid"]
            made.append(live["metadata"]["labels"][render_pd.ROLE_LABEL])
    assert made == ["prefill", "decode"]
