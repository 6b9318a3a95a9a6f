"""MLflow: a local SQLite store under the runs folder, or a remote `mlflow server`.

The run id is kept in <run>/mlflow.json, so a resumed run continues the same MLflow run;
before sending, the steps already there are read back, and points at or before them are not
sent again (no duplicates after a resume or a retry). A server's credentials come from the
environment only (MLFLOW_TRACKING_TOKEN, ...), read by MLflow itself; none is logged or saved.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from kiln.urls import redact
from kiln.config import JobConfig
from kiln.tracking.lineage import data_inputs, environment_has_secret

RUN_FILE = "mlflow.json"
_MAX_VALUE = 6000  # MLflow's limit on a parameter or tag value
_BAD_KEY = re.compile(r"[^\w\-. :/]")


def tracking_uri(cfg: JobConfig) -> str:
    uri = cfg.tracking.mlflow.uri if cfg.tracking.mlflow else None
    return uri or f"sqlite:///{(Path(cfg.out_dir) / 'mlflow.db').resolve()}"


class MlflowTracker:
    name = "mlflow"

    def __init__(self, cfg: JobConfig, run_dir: Path, resumed_step: int | None, tags: dict[str, str]):
        self.cfg, self.run_dir, self.resumed_step = cfg, Path(run_dir), resumed_step
        self.uri, self.tags = tracking_uri(cfg), tags
        self.last_steps: dict[str, int] = {}
        self.client = self.run_id = None
        self.params: dict[str, str] = {}
        # A dead server should be noticed in seconds, not after MLflow's default ~4 minutes of
        # retries: we retry ourselves and back-fill. An explicit setting in the environment wins.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")

    # Called from the tracker's own thread: importing MLflow and connecting take seconds.
    def _connect(self) -> None:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        stored = _read_json(self.run_dir / RUN_FILE)
        run = None
        if self.resumed_step != 0 and stored and stored.get("uri") == redact(self.uri):
            from mlflow.exceptions import MlflowException

            try:
                run = client.get_run(stored["run_id"])
            except MlflowException:  # the store was reset: start a new run
                run = None
        if run is not None:
            for key in run.data.metrics:
                history = client.get_metric_history(run.info.run_id, key)
                self.last_steps[key] = max((m.step for m in history), default=-1)
            self.params = dict(run.data.params)
            if self.resumed_step is not None:
                client.update_run(run.info.run_id, status="RUNNING")
        else:
            run = client.create_run(self._experiment_id(client), run_name=self.cfg.name,
                                    tags={"mlflow.source.name": "kiln", **self._clean(self.tags)})
            self._log_inputs(client, run.info.run_id)
            tmp = self.run_dir / (RUN_FILE + ".tmp")
            tmp.write_text(json.dumps({"uri": redact(self.uri), "run_id": run.info.run_id,
                                       "experiment_id": run.info.experiment_id}) + "\n")
            tmp.replace(self.run_dir / RUN_FILE)
        self.client, self.run_id = client, run.info.run_id

    def _experiment_id(self, client) -> str:
        from mlflow.exceptions import MlflowException

        name = self.cfg.tracking.mlflow.experiment
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return client.create_experiment(name)
        except MlflowException:  # another run created it in the meantime
            return client.get_experiment_by_name(name).experiment_id

    def _log_inputs(self, client, run_id: str) -> None:
        from mlflow.entities import Dataset, DatasetInput, InputTag

        inputs = []
        for d in data_inputs(self.cfg, self.run_dir):
            if d.get("manifest_sha256"):
                dataset = Dataset(name=d["name"], digest=d["manifest_sha256"][:36],
                                  source_type="local", source=json.dumps({"uri": d["path"]}))
                context = "evaluation" if d["name"].startswith(("val:", "stdlib:val")) else "training"
                inputs.append(DatasetInput(dataset, [InputTag("mlflow.data.context", context)]))
        if inputs:
            client.log_inputs(run_id, datasets=inputs)

    def write(self, items: list[dict]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        if self.client is None:
            self._connect()
        metrics, params, tags = [], [], []
        for item in items:
            if item["kind"] == "metrics":
                stamp = int(item["time"] * 1000)
                metrics += [Metric(_key(k), v, stamp, item["step"]) for k, v in item["metrics"].items()
                            if item["step"] > self.last_steps.get(_key(k), -1)]
            else:
                new, changed = self._new_params(item["params"])
                params += [Param(_key(k), v) for k, v in new.items()]
                tags += [RunTag(_key(k), v) for k, v in self._clean({**item["tags"], **changed}).items()]
        # log_batch takes at most 1000 metrics, 100 params and 100 tags per call; what got
        # through is remembered at once, so a retry after a later failure sends no point twice.
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i: i + 1000])
            for m in metrics[i: i + 1000]:
                self.last_steps[m.key] = max(self.last_steps.get(m.key, -1), m.step)
        for i in range(0, max(len(params), len(tags)), 100):
            self.client.log_batch(self.run_id, params=params[i: i + 100], tags=tags[i: i + 100])
        self.params.update({p.key: p.value for p in params})

    def _new_params(self, params: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
        """Parameters not yet on the run; those whose value changed on resume become tags
        (MLflow refuses to change a parameter)."""
        params = self._clean(params)
        new = {k: v for k, v in params.items() if _key(k) not in self.params}
        changed = {f"kiln.resumed_change.{k}": v for k, v in params.items()
                   if _key(k) in self.params and self.params[_key(k)] != v}
        return new, changed

    @staticmethod
    def _clean(values: dict[str, str]) -> dict[str, str]:
        return {k: str(v)[:_MAX_VALUE] for k, v in values.items()
                if not environment_has_secret(str(v))}

    def close(self, status: str) -> None:
        if self.client is not None:
            self.client.set_terminated(self.run_id, status)


def _key(name: str) -> str:
    return _BAD_KEY.sub("_", name)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
