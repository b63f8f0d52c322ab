"""The MLflow sink: one MLflow run per training job, metrics sent with ``log_batch``."""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sidestream.sinks import Report, RunInfo, Sink
from sidestream.sinks.support import (
    call_within,
    flatten_config,
    parse_resume_state,
    redact,
    secrets_in,
    shorten,
    uri_without_password,
)

__all__ = ["MlflowSink"]

_log = logging.getLogger(__name__)

# MLflow's documented limits (mlflow.utils.validation); kept here so a newer MLflow that relaxes
# them still receives requests an older server accepts.
MAX_METRICS_PER_BATCH = 1000
#: The tag holding a key unique to the sink that created the run (finds it again on a retry).
RUN_KEY_TAG = "sidestream.run_key"
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_KEY_LENGTH = 250
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000
MAX_RUN_NAME_LENGTH = 250

# Characters MLflow allows in metric, param and tag names; others become "_".
_NOT_ALLOWED_IN_KEY = re.compile(r"[^A-Za-z0-9_\-. :/]")
# MLflow reads its HTTP settings from the environment at each request; the values sinks put there.
_ENV_SET_BY_SINKS: dict[str, str] = {}
_SECRET_ENV = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "DATABRICKS_TOKEN")


class MlflowSink(Sink):
    """Logs every report to one MLflow run with ``MlflowClient.log_batch``.

    ``open`` creates the run (name, tags, flattened hyper-parameters as params) in
    ``experiment``, or continues the run saved in ``state_dict``. ``write`` sends a report's
    values as metrics at the report's step, at most 1000 per request, with no flush per step.
    A step at or below the last delivered one is skipped, so a resumed job never logs a step
    twice. If a request fails midway through a report, retrying the same report sends only what
    is missing.

    Requests fail fast (``http_timeout``, ``http_max_retries``) so the caller's retry loop, not
    MLflow's own, decides how long to keep trying while the server is away.

    Args:
        tracking_uri: MLflow tracking URI (``http://host:5000``, ``sqlite:///mlflow.db``);
            ``None`` uses MLflow's default (``MLFLOW_TRACKING_URI``).
        experiment: Experiment name; created when missing. ``None`` uses the default
            experiment.
        run_name: Run name; defaults to the ``RunInfo`` name given to ``open``.
        tags: Extra run tags, merged with the ``RunInfo`` tags.
        http_timeout: Whole seconds per HTTP request, set for this process through
            ``MLFLOW_HTTP_REQUEST_TIMEOUT`` unless the user set that variable. ``None`` leaves
            MLflow's default.
        http_max_retries: MLflow's own retries per request (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``,
            same rule). ``None`` leaves MLflow's default (several retries with long backoff).

    Example:
        >>> sink = MlflowSink(tracking_uri="sqlite:///mlflow.db", experiment="demo")
    """

    name = "mlflow"
    max_batch = 100  # reports per write_batch: a backlog goes out 1000 values per request

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
        *,
        http_timeout: int | None = 10,
        http_max_retries: int | None = 0,
    ) -> None:
        self._tracking_uri = tracking_uri
        self._experiment = experiment
        self._run_name = run_name
        self._tags = dict(tags or {})
        self._http_timeout = http_timeout
        self._http_max_retries = http_max_retries
        self._client: Any = None
        self._run_id: str | None = None
        self._last_step: int | None = None
        # Progress through the report being delivered: its step, how many chunks of it went
        # out, and whether the last attempt at the next chunk failed (it may have landed).
        self._pending_steps: tuple[int, ...] | None = None
        self._chunks_done = 0
        self._chunk_uncertain = False
        # Tags the run this sink creates, so a retry after a lost create_run reply finds it
        # instead of creating a second run.
        self._run_key = uuid.uuid4().hex
        self._create_attempted = False

    def __repr__(self) -> str:
        return (
            f"MlflowSink(tracking_uri={uri_without_password(self._tracking_uri)!r}, "
            f"experiment={self._experiment!r}, run_id={self._run_id!r})"
        )

    @property
    def run_id(self) -> str | None:
        """The MLflow run id once opened (or loaded from a state dict)."""
        return self._run_id

    def _secrets(self) -> list[str]:
        return secrets_in(_SECRET_ENV, [self._tracking_uri])

    def _failure(self, what: str, error: BaseException) -> RuntimeError:
        # The original exception may carry the tracking URI with its password or a token from
        # a request header, so only a redacted message leaves the sink, raised unchained.
        message = redact(f"{type(error).__name__}: {error}", self._secrets())
        uri = uri_without_password(self._tracking_uri)
        return RuntimeError(f"MlflowSink ({uri}): {what} failed: {message}")

    def _configure_http(self) -> None:
        for variable, value in (
            ("MLFLOW_HTTP_REQUEST_TIMEOUT", self._http_timeout),
            ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", self._http_max_retries),
        ):
            current = os.environ.get(variable)
            # A value the user set wins; one an earlier sink set may be replaced.
            if value is not None and (
                current is None or _ENV_SET_BY_SINKS.get(variable) == current
            ):
                os.environ[variable] = _ENV_SET_BY_SINKS[variable] = str(value)
        if uri_without_password(self._tracking_uri) != self._tracking_uri:
            # MLflow prints the run's URL, user information included, when a run ends.
            os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")

    def open(self, run: RunInfo) -> None:
        """Create the run, or continue the one from ``load_state_dict``.

        On resume the run is set back to RUNNING, only params it does not have yet are logged,
        and the last delivered step becomes the larger of the saved one and the largest step
        already on the server (so reports delivered after the checkpoint are not repeated).

        Raises:
            RuntimeError: If the tracking server cannot be reached or refuses (redacted message).
        """
        self._configure_http()
        from mlflow.tracking import MlflowClient

        failure: RuntimeError | None = None
        try:
            self._client = MlflowClient(tracking_uri=self._tracking_uri)
            if self._run_id is None:
                self._run_id = self._create_run(run)
                existing_params: Mapping[str, str] = {}
            else:
                existing = self._client.get_run(self._run_id)
                if existing.info.status != "RUNNING":
                    self._client.update_run(self._run_id, status="RUNNING")
                existing_params = existing.data.params
                self._last_step = _max_step(self._last_step, self._server_last_step(existing))
            self._log_params(run, existing_params)
        except Exception as error:
            failure = self._failure("open", error)
        if failure is not None:
            raise failure  # outside the handler: the original is not chained as its context

    def _create_run(self, run: RunInfo) -> str:
        experiment_id = None
        if self._experiment is not None:
            found = self._client.get_experiment_by_name(self._experiment)
            if found is None:
                try:
                    experiment_id = self._client.create_experiment(self._experiment)
                except Exception:
                    # Another process may have created it between the two calls.
                    found = self._client.get_experiment_by_name(self._experiment)
                    if found is None:
                        raise
                    experiment_id = found.experiment_id
            else:
                experiment_id = found.experiment_id
        else:
            experiment_id = "0"
        if self._create_attempted:
            # The last create_run may have reached the server with its reply lost.
            found = self._client.search_runs(
                [experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{self._run_key}'"
            )
            if found:
                return str(found[0].info.run_id)
        tags = {**dict(run.tags), **self._tags}
        name = self._run_name if self._run_name is not None else run.name
        run_tags = {_key(str(k)): shorten(str(v), MAX_TAG_VALUE_LENGTH) for k, v in tags.items()}
        self._create_attempted = True
        created = self._client.create_run(
            experiment_id,
            run_name=shorten(name, MAX_RUN_NAME_LENGTH) if name else None,
            tags={**run_tags, RUN_KEY_TAG: self._run_key},
        )
        return str(created.info.run_id)

    def _log_params(self, run: RunInfo, existing: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        params = [
            Param(_key(key), shorten(str(value), MAX_PARAM_VALUE_LENGTH))
            for key, value in flatten_config(run.config, plain_types=()).items()
        ]
        params = [param for param in params if param.key not in existing]
        for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            chunk = params[start : start + MAX_PARAMS_TAGS_PER_BATCH]
            self._client.log_batch(self._run_id, params=chunk)

    def _server_last_step(self, existing: Any) -> int | None:
        names = list(existing.data.metrics)
        if not names:
            return None
        history = self._client.get_metric_history(self._run_id, names[0])
        return max((int(metric.step) for metric in history), default=None)

    def write(self, report: Report) -> None:
        """Log the report's values at its step (skipped if that step was already delivered).

        Raises:
            RuntimeError: If the sink is not open, or a request failed (redacted message); what
                was delivered before the failure is not sent again when the report is retried.
        """
        self.write_batch([report])

    def write_batch(self, reports: Sequence[Report]) -> None:
        """Log consecutive reports in as few ``log_batch`` requests as MLflow allows.

        Up to ``max_batch`` reports at once (a backlog after an outage), 1000 values per request.
        Steps already delivered are skipped.

        Raises:
            RuntimeError: If the sink is not open, or a request failed (redacted message); what
                was delivered before the failure is not sent again when the batch is retried.
        """
        if self._client is None or self._run_id is None:
            raise RuntimeError("MlflowSink.write: call open() first")
        fresh = [r for r in reports if self._last_step is None or r.step > self._last_step]
        if not fresh:
            return
        from mlflow.entities import Metric

        steps = tuple(report.step for report in fresh)
        if self._pending_steps != steps:
            self._pending_steps, self._chunks_done, self._chunk_uncertain = steps, 0, False
        metrics = [
            Metric(_key(key), float(value), int(report.time * 1000), report.step)
            for report in fresh
            for key, value in report.values.items()
        ]
        chunks = [
            metrics[start : start + MAX_METRICS_PER_BATCH]
            for start in range(0, len(metrics), MAX_METRICS_PER_BATCH)
        ]
        failure: RuntimeError | None = None
        try:
            while self._chunks_done < len(chunks):
                chunk = chunks[self._chunks_done]
                if not (self._chunk_uncertain and self._landed(chunk)):
                    self._chunk_uncertain = True
                    self._client.log_batch(self._run_id, metrics=chunk)
                self._chunk_uncertain = False
                self._chunks_done += 1
        except Exception as error:
            where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"
            failure = self._failure(f"log_batch at {where}", error)
        if failure is not None:
            raise failure  # outside the handler: the original is not chained as its context
        self._last_step, self._pending_steps = steps[-1], None

    def _landed(self, chunk: Sequence[Any]) -> bool:
        # A request whose response was lost may still have been applied. log_batch is one
        # transaction, so one of its metrics tells whether the whole chunk is there.
        probe = chunk[-1]
        history = self._client.get_metric_history(self._run_id, probe.key)
        return any(int(metric.step) == probe.step for metric in history)

    def flush(self, timeout: float | None = None) -> bool:
        """Nothing is buffered: ``write`` returns once MLflow has the metrics."""
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Mark the run FINISHED; return whether that happened within ``timeout`` seconds."""
        if self._client is None or self._run_id is None:
            return True
        client, run_id = self._client, self._run_id
        started = time.monotonic()
        finished, error = call_within(
            lambda: client.set_terminated(run_id, status="FINISHED"),
            timeout,
            "sidestream-mlflow-close",
        )
        self._client = None
        if not finished:
            _log.warning("MlflowSink.close: run not marked finished within %.1f s", timeout)
            return False
        if error is not None:
            _log.warning("%s", self._failure("set_terminated", error))
            return False
        _log.debug("MlflowSink.close took %.3f s", time.monotonic() - started)
        return True

    def state_dict(self) -> dict[str, Any]:
        """``{"run_id", "last_step"}``: enough to continue the same run. Never credentials."""
        return {"run_id": self._run_id, "last_step": self._last_step}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue the saved run at the next ``open``.

        Raises:
            ValueError: If ``state_dict`` lacks ``run_id`` / ``last_step`` or has wrong types.
        """
        run_id, last_step = parse_resume_state(state_dict, "run_id", "MlflowSink")
        self._run_id, self._last_step = run_id, last_step


def _max_step(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def _key(name: str) -> str:
    return shorten(_NOT_ALLOWED_IN_KEY.sub("_", name), MAX_KEY_LENGTH)
