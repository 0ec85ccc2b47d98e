"""A model kept in the run directory during an outage is logged once, however often its upload is tried
(runner/tracking/calls.py upload_model; issue 24's closing note: the logged model's id lived only in the
writer's memory, so the journal's copy of the call, made again by a resume or the next opening of the
store, created a second logged model). A real `mlflow server` (tests/servers/mlflow.py) is stopped in the
middle of the upload, after the logged model was created, and the call is made again from what the journal
holds once the server is back."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.tracking import calls
from tests.servers.mlflow import mlflow_server, restarted, stop


@pytest.mark.slow  # two server starts: 20-60 s on a loaded machine
@pytest.mark.cluster
def test_a_model_upload_cut_by_a_server_stop_and_made_again_from_the_journal_logs_one_model(
        tmp_path: Path, migrated_mlflow_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow.pytorch
    import torch

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the stopped server fails the call at once
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    mlflow.pytorch.save_model(net, str(tmp_path / "mlflow_model"), serialization_format="pickle", pip_requirements=[])
    args = {"dir": str(tmp_path / "mlflow_model"), "name": "model", "step": 40, "tags": {"runner.source": "last"},
            "source": "last@step 40"}
    held = json.loads(json.dumps(args))  # the call as the run directory's journal holds it
    with mlflow_server(tmp_path / "server", migrated_mlflow_store) as (uri, server):
        client = MlflowClient(uri)
        experiment = client.create_experiment("upload")
        run_id = client.create_run(experiment).info.run_id

        class StopsTheServerMidUpload(MlflowClient):
            def log_model_artifacts(self, model_id: str, local_dir: str) -> None:
                stop(server)  # the logged model exists; its files never arrive
                super().log_model_artifacts(model_id, local_dir)

        with pytest.raises(Exception):
            calls.upload_model(StopsTheServerMidUpload(uri), run_id, args)
    port = int(uri.rsplit(":", 1)[1])
    with restarted(tmp_path / "server", port) as (uri, _):
        client = MlflowClient(uri)
        calls.make(client, run_id, "model", held)  # a resume, or the next opening of the store, makes it again
        calls.make(client, run_id, "model", dict(held))  # and once more: a replay that died before confirming
        models = client.search_logged_models([experiment], filter_string=f"source_run_id = '{run_id}'")
        assert len(models) == 1, [(m.model_id, str(m.status)) for m in models]
        (model,) = models
        assert str(model.status).endswith("READY")
        run = client.get_run(run_id)
        assert [(o.model_id, o.step) for o in run.outputs.model_outputs] == [(model.model_id, 40)]
        assert run.data.tags["runner.logged_model"] == f"models:/{model.model_id} (last@step 40)"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")
        got = mlflow.pytorch.load_model(f"models:/{model.model_id}").state_dict()
        assert all(torch.equal(got[k], v) for k, v in net.state_dict().items())
