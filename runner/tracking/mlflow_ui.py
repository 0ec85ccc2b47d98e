"""`make ui` (python -m runner.tracking.mlflow_ui): MLflow's UI over the local store, opening experiments on
their runs table however they are reached (the experiment list, a bookmark of #/experiments/<id>, a
run page's breadcrumb).

MLflow 3.17's UI picks its GenAI or model-training view from one switch per browser (the sidebar's
"GenAI | Model training"), kept in the browser's localStorage and GenAI until the user flips it; no
server setting or experiment tag changes that default. So this serves MLflow's own app with one line
added to its page: where the browser holds no choice yet, the switch starts on model training, and
each runner experiment's runs table starts with the columns of runner's saved view (the objective and
the main metrics; the UI keeps a table's columns per browser too). What the user changes is kept.
Everything else is `mlflow ui`.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

from runner.tracking.mlflow_store import (DEFAULT_URI, MACHINE_LEARNING, RUNS_VIEW, VIEW_TAG_PREFIX, WORKFLOW_STORAGE_KEY,
                                 open_client)

# Where the 3.17 UI keeps an experiment page's table state (columns, expanded rows) in localStorage.
TABLE_STORAGE_KEY = 'MLflowLocalStorage-1.1-ExperimentPage-["{id}"]-ReactComponentState'
PRESET = """<script>try{var s=localStorage,t=%s,k;
if(s.getItem(%s)===null)s.setItem(%s,%s);
for(k in t)if(s.getItem(%s.replace("{id}",k))===null)s.setItem(%s.replace("{id}",k),JSON.stringify(t[k]));
}catch(e){}</script>"""


def preset(tables: dict[str, dict[str, Any]]) -> str:
    """The script that starts the UI's switch on model training and the tables (experiment id -> state)."""
    key, table = json.dumps(WORKFLOW_STORAGE_KEY), json.dumps(TABLE_STORAGE_KEY)
    states = json.dumps(tables).replace("</", "<\\/")
    return PRESET % (states, key, key, json.dumps(json.dumps(MACHINE_LEARNING)), table, table)


def runner_tables(client: Any) -> dict[str, dict[str, Any]]:
    """Experiment id -> the runs table state to start from: the columns of runner's saved view."""
    tables = {}
    for experiment in client.search_experiments(max_results=1000):
        try:
            state = json.loads(json.loads(experiment.tags[VIEW_TAG_PREFIX + RUNS_VIEW])["state"])
            tables[experiment.experiment_id] = {"selectedColumns": list(state["selectedColumns"])}
        except (KeyError, ValueError, TypeError):
            continue  # not runner's, or a view it cannot read: the UI's defaults
    return tables


def build_app(uri: str, artifacts_destination: str = "./mlartifacts") -> Any:
    """MLflow's server app (FastAPI around its Flask app) over the store `uri`, as `mlflow ui` configures it."""
    from mlflow.server import (ARTIFACT_ROOT_ENV_VAR, ARTIFACTS_DESTINATION_ENV_VAR, BACKEND_STORE_URI_ENV_VAR,
                               REGISTRY_STORE_URI_ENV_VAR, SERVE_ARTIFACTS_ENV_VAR)
    from mlflow.server import app as flask_app
    from mlflow.server.handlers import initialize_backend_stores
    from mlflow.utils.server_cli_utils import resolve_default_artifact_root

    root = resolve_default_artifact_root(True, None, uri)
    os.environ.update({BACKEND_STORE_URI_ENV_VAR: uri, REGISTRY_STORE_URI_ENV_VAR: uri, ARTIFACT_ROOT_ENV_VAR: root,
                       SERVE_ARTIFACTS_ENV_VAR: "true", ARTIFACTS_DESTINATION_ENV_VAR: artifacts_destination})
    initialize_backend_stores(uri, uri, root)
    client = open_client(uri, end_orphans=False)  # the UI ends no one's runs

    from flask import request

    @flask_app.after_request
    def preset_model_training(response: Any) -> Any:
        if request.path == "/" and response.status_code == 200 and response.mimetype == "text/html":
            response.direct_passthrough = False  # a sent file: read it to change it
            page = response.get_data(as_text=True)
            response.set_data(page.replace("<head>", "<head>" + preset(runner_tables(client)), 1))
            for header in ("ETag", "Last-Modified"):  # a page cached from plain `mlflow ui` is not this one
                response.headers.pop(header, None)
        return response

    from mlflow.server.fastapi_app import app
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m runner.tracking.mlflow_ui", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend-store-uri", default=DEFAULT_URI, help=f"the MLflow store (default {DEFAULT_URI})")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    args = parser.parse_args(argv)
    import uvicorn

    app = build_app(args.backend_store_uri)
    print(f"MLflow UI: http://{args.host}:{args.port}  (each run prints the link to its experiment's runs table)",
          flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
