"""The MLflow sink: one MLflow run per training job, metrics sent with ``log_batch``."""

from __future__ import annotations

import functools
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

from sidestream._logs import get_logger
from sidestream.sinks import PermanentSinkError, Report, RunInfo, TrackerSink, is_permanent
from sidestream.sinks.config import install_hint
from sidestream.sinks.status import http_status
from sidestream.sinks.support import (
    KILLED_EXIT_CODE,
    check_directory_path,
    check_name_lengths,
    check_option_types,
    failed_exit_code,
    flatten_config,
    name_digest,
    redact,
    secrets_in,
    shorten,
    uri_without_password,
    working_directory_hint,
)
from sidestream_mlflow._http import request_settings

logger = get_logger("sidestream.sinks")

__all__ = ["MlflowSink"]

_T = TypeVar("_T")

# MLflow's documented limits (mlflow.utils.validation); kept here so a newer MLflow that relaxes
# them still receives requests an older server accepts.
MAX_METRICS_PER_BATCH = 1000
#: The tag holding a key unique to the sink that created the run (finds it again on a retry).
RUN_KEY_TAG = "sidestream.run_key"
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_KEY_LENGTH = 250
MAX_PARAM_VALUE_LENGTH = 6000
# MLflow 2.16 tracking servers refuse tag values over 5000 characters; later ones allow 8000.
# The client (mlflow 3.9 or later) may talk to an older server and cannot tell its limit: the
# lower one.
MAX_TAG_VALUE_LENGTH = 5000
MAX_RUN_NAME_LENGTH = 250

# Characters MLflow allows in metric, param and tag names; others become "_".
# MLflow's own rule (mlflow.utils.validation): word characters of any script, - . space : /.
_NOT_ALLOWED_IN_KEY = re.compile(r"[^\w\-. :/]")
INSTALL = install_hint("mlflow")
_SECRET_ENV = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "DATABRICKS_TOKEN")


class MlflowSink(TrackerSink):
    """Logs every report to one MLflow run with ``MlflowClient.log_batch``.

    ``open`` creates the run (name, tags, flattened hyper-parameters as params) in
    ``experiment``, or continues the run saved in ``state_dict``. ``write`` sends a report's
    values as metrics at the report's step, at most 1000 per request, with no flush per step;
    streams may arrive in any step order. A step at or below its stream's last delivered one is
    skipped, so a resumed job never logs a step twice. If a request fails midway through a
    report, retrying the same report sends only what is missing.

    The sink's own requests fail fast (``http_timeout``, ``http_max_retries``) so the
    pipeline's retry loop, not MLflow's, decides how long to keep trying while the server is
    away. These settings apply to the sink's requests only: MLflow calls elsewhere in the
    process keep MLflow's settings (no environment variable is changed).

    Args:
        tracking_uri: MLflow tracking URI (``http://host:5000``, ``sqlite:///mlflow.db``);
            ``None`` uses MLflow's default (``MLFLOW_TRACKING_URI``).
        experiment: Experiment name; created when missing. ``None`` uses the default
            experiment.
        run_name: Run name; defaults to the ``RunInfo`` name given to ``open``.
        tags: Extra run tags, merged with the ``RunInfo`` tags.
        http_timeout: Seconds per HTTP request of this sink. ``None`` leaves MLflow's setting
            (``MLFLOW_HTTP_REQUEST_TIMEOUT``).
        http_max_retries: MLflow's own retries per request of this sink. ``None`` leaves
            MLflow's setting (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``: several, with long backoff).

    Example:
        >>> sink = MlflowSink(tracking_uri="sqlite:///mlflow.db", experiment="demo")
    """

    name = "mlflow"
    identity_key = "run_id"
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
        super().__init__()
        # A timeout of 0 would fail every request (requests refuses it): at least 1 s.
        for option, value, low in (
            ("http_timeout", http_timeout, 1),
            ("http_max_retries", http_max_retries, 0),
        ):
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                # MLflow takes whole seconds (MLFLOW_HTTP_REQUEST_TIMEOUT is an int).
                raise TypeError(f"{option}: expected an int >= {low} or None, got {value!r}")
            if value < low:
                raise ValueError(f"{option}: expected an int >= {low} or None, got {value!r}")
        check_option_types(
            "MlflowSink",
            {"tracking_uri": tracking_uri, "experiment": experiment, "run_name": run_name},
            {"tracking_uri": (str,), "experiment": (str,), "run_name": (str,)},
        )
        if experiment == "":
            # MLflow refuses it at open, on rank 0's sink thread once training has started.
            raise ValueError(
                "experiment: expected a non-empty experiment name, or None for MLflow's "
                "default experiment; got ''"
            )
        if experiment is not None and len(experiment) > _MAX_EXPERIMENT_NAME:
            # The same: refused only at open.
            raise ValueError(
                f"experiment: expected at most {_MAX_EXPERIMENT_NAME} characters (MLflow's "
                f"limit), got {len(experiment)}"
            )
        if tags is not None:
            if not isinstance(tags, Mapping):
                raise TypeError(
                    f"tags: expected a mapping of str to str, got {type(tags).__name__}"
                )
            # The run's own tags' checks (str names, none empty, encodable), here and not when
            # rank 0 opens the sink once training has started.
            RunInfo(tags=tags)
            _check_own_tags(tags, run_name)
        if tracking_uri is not None:
            _check_tracking_uri(tracking_uri)
        else:
            _check_environment_uri()
        # A relative SQLite file or store path is fixed now, as JsonlSink's path is: read at
        # open, it followed a later os.chdir and the job wrote to another database. So is one
        # in MLFLOW_TRACKING_URI, which MLflow would read at open too.
        if tracking_uri is None:
            from_environment = os.environ.get("MLFLOW_TRACKING_URI") or None
            if from_environment is not None:
                fixed = _absolute_store(from_environment)
                tracking_uri = fixed if fixed != from_environment else None
        self._tracking_uri = None if tracking_uri is None else _absolute_store(tracking_uri)
        self._experiment = experiment
        self._run_name = run_name
        self._tags = dict(tags or {})
        self._http_timeout = http_timeout
        self._http_max_retries = http_max_retries
        self._client: Any = None
        self._unfinished = False  # leave_unfinished: the next close leaves the run RUNNING
        self._keep_status = False  # keep_run_status: open and close leave the status alone
        self._run_id: str | None = None
        # Progress through the reports being delivered: their streams and steps, how many
        # chunks went out, and whether the last attempt at the next chunk failed (it may
        # have landed).
        self._pending_steps: tuple[tuple[str, int], ...] | None = None
        self._chunks_done = 0
        self._chunk_uncertain = False
        # Steps of each metric the server held below its largest, by key, asked for when a
        # replayed report's value is held (backend_has_step); reset at open.
        self._history_steps: dict[str, frozenset[int]] = {}
        # Tags the run this sink creates, so a retry after a lost create_run reply finds it
        # instead of creating a second run.
        # Tags the run this sink creates: an open that finds no run id (a first open whose
        # create_run reply was lost, a child process restarted mid-open, a checkpoint taken
        # while the server was down) looks for it before creating one. Kept in the state.
        self._run_key = uuid.uuid4().hex

    @classmethod
    def check_available(cls) -> None:
        """Raise ``ImportError`` with the install command if mlflow is missing."""
        try:
            import mlflow  # noqa: F401
        except ImportError as error:
            raise ImportError(f"MlflowSink needs mlflow ({error}): {INSTALL}") from None

    def __repr__(self) -> str:
        return (
            f"MlflowSink(tracking_uri={uri_without_password(self._tracking_uri)!r}, "
            f"experiment={self._experiment!r}, run_id={self._run_id!r})"
        )

    @property
    def run_id(self) -> str | None:
        """The MLflow run id once opened (or loaded from a state dict)."""
        return self._run_id

    @property
    def identity(self) -> str | None:
        """The run id."""
        return self._run_id

    @identity.setter
    def identity(self, value: str | None) -> None:
        self._run_id = value

    def _secrets(self) -> list[str]:
        return secrets_in(_SECRET_ENV, [self._used_uri()])

    def _used_uri(self) -> str | None:
        """The tracking URI MLflow uses: ``tracking_uri``, else ``MLFLOW_TRACKING_URI``.

        A password in the variable is as secret as one in the option: MLflow's errors name the
        request's URL with it, and it prints the run's URL with it when the run ends.
        """
        return self._tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None

    def describe_error(self, error: BaseException) -> str:
        """``error`` as text without the tracking URI's password or tokens."""
        return redact(f"{type(error).__name__}: {error}", self._secrets())

    def _failure(self, what: str, error: BaseException) -> RuntimeError:
        # The original exception may carry the tracking URI with its password or a token from
        # a request header, so only a redacted message leaves the sink, raised unchained; its
        # kind (permanent or worth a retry) survives in the class.
        uri = uri_without_password(self._tracking_uri)
        tls_hint = self._tls_hint(error)
        permanent = is_permanent(error) or _unreadable_database_uri(error) or bool(tls_hint)
        kind = PermanentSinkError if permanent else RuntimeError
        hint = working_directory_hint(error) or tls_hint or self._auth_hint(error)
        return kind(f"MlflowSink ({uri}): {what} failed: {self.describe_error(error)}{hint}")

    def _uri_setting(self) -> str:
        """Where the tracking URI was set: the option, or the environment variable."""
        return "tracking_uri" if self._tracking_uri is not None else "MLFLOW_TRACKING_URI"

    def _tls_hint(self, error: BaseException) -> str:
        """The fix for a TLS handshake that no retry gets through, else ``""``.

        An ``https://`` URI of a server that speaks plain HTTP, or a certificate this machine
        does not trust, failed every request of the job the same way: retried until close, the
        job's reports ended in a spool file with only a WARNING said at the first attempt.
        A TLS connection dropped midway (``SSLEOFError``) stays a transient error.
        """
        text = " ".join(str(link) for link in _error_chain(error))
        if "WRONG_VERSION_NUMBER" in text:
            return (
                f" (the server answers plain HTTP, not TLS: make {self._uri_setting()} "
                "http://... instead of https://...)"
            )
        if "CERTIFICATE_VERIFY_FAILED" in text:
            return (
                " (this machine does not trust the server's certificate: set "
                "MLFLOW_TRACKING_SERVER_CERT_PATH to its CA bundle, or "
                "MLFLOW_TRACKING_INSECURE_TLS=true to skip the check)"
            )
        return ""

    def _auth_hint(self, error: BaseException) -> str:
        """Which setting to fix when the server refused the credentials (401) or the user (403).

        MLflow's own message says only "You are not authenticated" or "Permission denied".
        """
        status = http_status(error)
        in_uri = urlparse(self._used_uri() or "").username is not None
        # A name in the URI is hidden with its password (it may be a token); the variable's
        # is shown, as MLflow's own messages do.
        user = os.environ.get("MLFLOW_TRACKING_USERNAME")
        token = os.environ.get("MLFLOW_TRACKING_TOKEN")
        if status == 401:
            if not (in_uri or user or token):
                return (
                    " (no credentials were given: set MLFLOW_TRACKING_USERNAME and "
                    "MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN)"
                )
            if in_uri:
                where = f"the user:password@ in {self._uri_setting()}"
            elif user:
                where = f"MLFLOW_TRACKING_USERNAME ({user!r}) / MLFLOW_TRACKING_PASSWORD"
            else:
                where = "MLFLOW_TRACKING_TOKEN"
            return f" (the server refused the credentials: check {where})"
        if status == 403:
            where = (
                "MLflow's default experiment"
                if self._experiment is None
                else (f"experiment {self._experiment!r}")
            )
            who = f"user {user!r}" if user and not in_uri else "these credentials"
            return (
                f" ({who} may not write to {where}: ask its owner for EDIT permission, or "
                "log to an experiment of your own)"
            )
        return ""

    def _call(self, action: Callable[[], _T]) -> _T:
        """Run MLflow client calls with this sink's HTTP settings (this thread only)."""
        with request_settings(self._http_timeout, self._http_max_retries):
            return action()

    def _configure_http(self) -> None:
        uri = self._used_uri()
        if uri_without_password(uri) != uri:
            # MLflow prints the run's URL, user information included, when a run ends.
            os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
            _quiet_run_urls_with_passwords()

    def open(self, run: RunInfo) -> None:
        """Create the run, or continue the one from ``load_state_dict``.

        On resume the run is set back to RUNNING, only params it does not have yet are logged,
        and the last delivered step becomes the larger of the saved one and the largest step
        already on the server (so reports delivered after the checkpoint are not repeated).

        Raises:
            PermanentSinkError: If mlflow is not installed, or the server refuses the request
                for good (HTTP 4xx other than 408/429, a bad argument).
            RuntimeError: If the tracking server cannot be reached (redacted message).
        """
        self._unfinished = False
        self._configure_http()
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as error:
            message = f"MlflowSink: mlflow is not installed ({error}); {INSTALL}"
            raise PermanentSinkError(message) from None

        failure: RuntimeError | None = None
        try:
            _make_sqlite_folder(self._used_uri())
            self._client = MlflowClient(tracking_uri=self._tracking_uri)
            self._call(lambda: self._open_run(run))
        except Exception as error:
            failure = self._failure("open", error)
        if failure is not None:
            raise failure  # outside the handler: the original is not chained as its context

    def _open_run(self, run: RunInfo) -> None:
        created = False
        if self._run_id is None:
            self._run_id, created = self._find_or_create_run(run)
        if created:
            self._keep_status = False  # no status of its own yet: ended at close as usual
            existing_params: Mapping[str, str] = {}
        else:
            existing = self._resumed_run()
            if existing.info.lifecycle_stage == "deleted":
                raise PermanentSinkError(
                    f"the run {self._run_id} this job resumes was deleted on the server; "
                    f"restore it (mlflow runs restore --run-id {self._run_id}) and start the "
                    "job again, or start it without this sink's checkpointed state for a new run"
                )
            if existing.info.status != "RUNNING" and not self._keep_status:
                self._client.update_run(self._run_id, status="RUNNING")
            existing_params = existing.data.params
            name = self._run_name if self._run_name is not None else run.name
            saved_name = existing.info.run_name
            if (
                name
                and saved_name
                and saved_name != shorten(name, MAX_RUN_NAME_LENGTH)
                and not self.replaying  # a replay's run is the kept one, not a job's config
            ):
                self.warn_once(
                    "other-run-name",
                    f"MlflowSink: the checkpoint's run {self._run_id} is named {saved_name!r}, "
                    f"this job {name!r}: a checkpoint of another job? The steps that run already "
                    "has are skipped, not logged again",
                )
            self.found_values_in_backend(self._server_last_steps(existing))
        self._history_steps = {}
        self._log_params(run, existing_params)

    def _resumed_run(self) -> Any:
        """The run this job resumes, from the server."""
        from mlflow.exceptions import MlflowException

        try:
            return self._client.get_run(self._run_id)
        except MlflowException as error:
            if getattr(error, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                raise
        raise PermanentSinkError(
            f"the run {self._run_id} this job resumes is not on the server (deleted and "
            "purged, or another server); start the job without this sink's checkpointed "
            "state for a new run"
        )

    def _find_or_create_run(self, run: RunInfo) -> tuple[str, bool]:
        """The id of the run tagged with this sink's run key, and whether it was just created."""
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
                if found.lifecycle_stage == "deleted":
                    # MLflow's refusal of the run named only the experiment's id and its state.
                    raise PermanentSinkError(
                        f"the experiment {self._experiment!r} (id {experiment_id}) is deleted "
                        "on the server and takes no new runs; restore it (mlflow experiments "
                        f"restore --experiment-id {experiment_id}) or give another experiment "
                        "name"
                    )
        else:
            experiment_id = "0"
        # An earlier create_run of this sink (or of the job it resumes) may have reached the
        # server without this process learning the run id.
        found = self._client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{self._run_key}'"
        )
        if found:
            return str(found[0].info.run_id), False
        tags = {**dict(run.tags), **self._tags}
        name = self._run_name if self._run_name is not None else run.name
        tags, name = self._settled_tags(tags, name)
        run_tags = {_key(str(k)): shorten(str(v), MAX_TAG_VALUE_LENGTH) for k, v in tags.items()}
        created = self._client.create_run(
            experiment_id,
            run_name=shorten(name, MAX_RUN_NAME_LENGTH) if name else None,
            tags={**run_tags, RUN_KEY_TAG: self._run_key},
        )
        return str(created.info.run_id), True

    def _settled_tags(
        self, tags: dict[str, Any], name: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """The tags and run name ``create_run`` takes, with a warning for what was set aside.

        A ``RunInfo`` tag ``mlflow.runName`` other than the run's name made MLflow refuse the
        run (permanently, at open, after training started); the name wins, and with no name
        the tag is the name. ``sidestream.run_key`` is this sink's own: a resumed job finds
        its run by it, so the user's value was silently replaced; now said.
        """
        tags = dict(tags)
        if RUN_KEY_TAG in tags:
            self.warn_once(
                "run key tag",
                f"MlflowSink: the tag {RUN_KEY_TAG!r} is the sink's own (a resumed job finds "
                f"its run by it): your value {tags.pop(RUN_KEY_TAG)!r} is not set; use "
                "another tag name",
            )
        given = tags.get(_RUN_NAME_TAG)
        if given is not None:
            if not name:
                name = str(tags.pop(_RUN_NAME_TAG))
            elif str(given) != name:
                tags.pop(_RUN_NAME_TAG)
                self.warn_once(
                    "run name tag",
                    f"MlflowSink: the tag {_RUN_NAME_TAG!r} ({given!r}) differs from the run's "
                    f"name ({name!r}), which MLflow refuses: the run is named {name!r}",
                )
        return tags, name

    def extra_state(self) -> dict[str, Any]:
        """The run key and experiment: where a resumed job (or a replay) finds its run.

        A run whose id this job never learned is found by its key, in the experiment it was to
        be made in.
        """
        return {"run_key": self._run_key, "experiment": self._experiment}

    def load_extra_state(self, state_dict: Mapping[str, Any]) -> None:
        """Take the saved run key (a state from before run keys keeps this sink's own).

        The saved experiment is the run's: a sink made without ``experiment`` takes it (a
        replay of a kept spool built from the command line then makes the job's run in the
        job's experiment, not in MLflow's default one), and one made with another takes it
        too, with a warning: the run stays where it is, and the state says so.
        """
        run_key = state_dict.get("run_key")
        if isinstance(run_key, str) and run_key.isalnum():  # it goes into a search filter
            self._run_key = run_key
        if "experiment" not in state_dict:  # saved before the sink kept it
            return
        experiment = state_dict["experiment"]
        if experiment is not None and not isinstance(experiment, str):
            return
        if self._experiment is not None and self._experiment != experiment:
            where = "MLflow's default experiment" if experiment is None else repr(experiment)
            self.warn_once(
                "experiment",
                f"MlflowSink: the checkpoint's run is in {where}; it is resumed there, not in "
                f"the configured {self._experiment!r} (a new run in {self._experiment!r} "
                "needs a job that does not resume this checkpoint)",
            )
        self._experiment = experiment

    def replay_options(self) -> dict[str, Any]:
        """The tracking URI (its password hidden, a local store's path absolute), for a replay.

        A replay from the command line given no URI then delivers to the job's server or
        store, not to MLflow's default store where the command runs.
        """
        tracking_uri = self._tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not tracking_uri:
            try:
                import mlflow

                tracking_uri = mlflow.get_tracking_uri()  # the default store this job used
            except Exception:
                return {}
        options: dict[str, Any] = {
            "tracking_uri": uri_without_password(_absolute_store(tracking_uri))
        }
        if self._run_name is not None:  # a replay names a run it creates as the job would
            options["run_name"] = self._run_name
        return options

    def _log_params(self, run: RunInfo, existing: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        params = [
            Param(_key(key), shorten(str(value), MAX_PARAM_VALUE_LENGTH))
            for key, value in flatten_config(run.config, plain_types=()).items()
        ]
        changed = sorted(p.key for p in params if p.key in existing and existing[p.key] != p.value)
        # A replay's config is the job's as kept in JSON (a tuple comes back a list): not a
        # config that changed.
        if changed and not self.replaying:
            self.warn_once(
                "changed-params",
                f"MlflowSink: the resumed run keeps its params {changed}; this job's config has "
                "other values for them (MLflow params cannot change)",
            )
        params = [param for param in params if param.key not in existing]
        for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            chunk = params[start : start + MAX_PARAMS_TAGS_PER_BATCH]
            self._client.log_batch(self._run_id, params=chunk)

    def _server_last_steps(self, existing: Any) -> dict[str, int]:
        """The largest step of each metric of the run on the server.

        The run's latest metrics carry their step (the latest is the one at the largest step),
        so one ``get_run`` answers for all of them; a client without that asks each metric's
        history.
        """
        latest = getattr(existing.data, "_metric_objs", None)
        if latest is not None:
            return {str(metric.key): int(metric.step) for metric in latest}
        found: dict[str, int] = {}
        for name in existing.data.metrics:
            history = self._client.get_metric_history(self._run_id, name)
            last = max((int(metric.step) for metric in history), default=None)
            if last is not None:
                found[name] = last
        return found

    def backend_name(self, name: str) -> str:
        """The MLflow key of a value name (characters MLflow refuses replaced, shortened)."""
        return _key(name)

    def backend_has_step(self, name: str, step: int) -> bool:
        """Whether the run holds value ``name`` at ``step``: its metric history, once per key.

        Asked with the sink's ``http_timeout`` and ``http_max_retries``. ``False`` if the server
        cannot answer (not asked again for that key): the value then counts as possibly
        missing. Nothing this sink sends goes below a key's largest step, so a key's steps
        below it stay as they were asked.
        """
        client, run_id = self._client, self._run_id
        if client is None or run_id is None:
            return False
        key = _key(name)
        steps = self._history_steps.get(key)
        if steps is None:
            try:
                history = self._call(lambda: client.get_metric_history(run_id, key))
                steps = frozenset(int(metric.step) for metric in history)
            except Exception:
                steps = frozenset()
            self._history_steps[key] = steps
        return step in steps

    def send(self, reports: Sequence[Report]) -> None:
        """Log reports in as few ``log_batch`` requests as MLflow allows.

        Up to ``max_batch`` reports at once (a backlog after an outage), 1000 values per request.

        Raises:
            RuntimeError: If the sink is not open, or a request failed (redacted message); what
                was delivered before the failure is not sent again when the batch is retried.
        """
        if self._client is None or self._run_id is None:
            raise RuntimeError("MlflowSink.write: call open() first")
        from mlflow.entities import Metric

        fresh = list(reports)
        steps = tuple((report.stream, report.step) for report in fresh)
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
            self._call(lambda: self._send_chunks(chunks))
        except Exception as error:
            first, last = steps[0][1], steps[-1][1]
            where = f"step {first}" if len(steps) == 1 else f"steps {first}..{last}"
            failure = self._failure(f"log_batch at {where}", error)
        if failure is not None:
            raise failure  # outside the handler: the original is not chained as its context
        self._pending_steps = None

    def _send_chunks(self, chunks: list[list[Any]]) -> None:
        while self._chunks_done < len(chunks):
            chunk = chunks[self._chunks_done]
            if not (self._chunk_uncertain and self._landed(chunk)):
                self._chunk_uncertain = True
                self._client.log_batch(self._run_id, metrics=chunk)
            self._chunk_uncertain = False
            self._chunks_done += 1

    def _landed(self, chunk: Sequence[Any]) -> bool:
        # A request whose response was lost may still have been applied. log_batch is one
        # transaction, so one of its metrics tells whether the whole chunk is there.
        probe = chunk[-1]
        history = self._client.get_metric_history(self._run_id, probe.key)
        return any(int(metric.step) == probe.step for metric in history)

    def leave_unfinished(self) -> None:
        """Leave the run RUNNING at the next close: it lacks reports kept for a replay."""
        self._unfinished = True

    def keep_run_status(self) -> None:
        """Leave the run's status as found (a replay of a crashed job's spool): see ``Sink``."""
        self._keep_status = True

    def close(self, timeout: float | None = None) -> bool:
        """End the run; return whether that happened within ``timeout`` seconds.

        FINISHED, or, closed at exit after an uncaught exception (or in a ``ProcessSink``
        child whose trainer failed or vanished), FAILED (KILLED for Ctrl-C or a killed
        trainer), as MLflow's own ``end_run`` marks them. After ``leave_unfinished`` (its
        pipeline gave up with reports kept, a replay stopped short) the run stays RUNNING;
        after ``keep_run_status`` (a replay of a crashed job's spool into its existing run)
        the status stays as the replay's ``open`` found it.

        A server away at that moment (a 503, a dropped connection, a restart) is retried with
        backoff until ``timeout`` (30 s for ``None``); a refusal (HTTP 4xx) is not, and its
        warning gives the call that ends the run.
        """
        if self._client is None or self._run_id is None:
            return True
        client, run_id = self._client, self._run_id
        self._client = None
        if self._keep_status:
            self._keep_status = False
            logger.info("MlflowSink: run %s left in its status: its job's end is unknown", run_id)
            return True
        if self._unfinished:
            # Reports it was given are kept for a replay: FINISHED would say the run is whole.
            logger.info(
                "MlflowSink: run %s left RUNNING: it lacks reports that are kept for a replay",
                run_id,
            )
            return True
        code = failed_exit_code()
        status = "FINISHED" if code is None else "KILLED" if code == KILLED_EXIT_CODE else "FAILED"
        # The pipeline has no retry after close: a server that is away for a moment (one 503,
        # a dropped connection, a restart) left the run RUNNING for good although it holds
        # every value. Retried here instead, within the close's own timeout.
        deadline = time.monotonic() + (_CLOSE_RETRY_S if timeout is None else timeout)

        def finish_once() -> None:
            try:
                client.set_terminated(run_id, status=status)
            except Exception as error:
                # The reply may be lost after the server ended the run: ask it once.
                if _ended_on_server(client, run_id, status):
                    return
                if not _url_print_failed(error):
                    raise
                # MLflow prints the run's URL to stdout before it ends the run: a job whose
                # stdout is a closed pipe (`| head`), full or closed left its run RUNNING,
                # retried until close gave up. The URL cannot be shown there anyway.
                os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
                client.set_terminated(run_id, status=status)

        def finish() -> None:
            delay = _CLOSE_RETRY_INITIAL_S
            while True:
                try:
                    finish_once()
                    return
                except Exception as error:
                    permanent = is_permanent(error)
                    if permanent or deadline - time.monotonic() <= delay:
                        raise self._close_failure(run_id, status, error, permanent) from None
                time.sleep(delay)
                delay = min(2 * delay, _CLOSE_RETRY_MAX_S)

        return self.within(lambda: self._call(finish), timeout, "close")

    def _close_failure(
        self, run_id: str, status: str, error: BaseException, permanent: bool
    ) -> RuntimeError:
        """Why the run could not be ended, and how to end it: its values are all delivered."""
        why = "refused" if permanent else "could not be reached within the close's timeout"
        return RuntimeError(
            f"the server {why} ({self.describe_error(error)}); run {run_id} holds every value "
            f"delivered but stays RUNNING: end it with MlflowClient().set_terminated("
            f"{run_id!r}, status={status!r})"
        )


_RUN_NAME_TAG = "mlflow.runName"


def _check_own_tags(tags: Mapping[str, str], run_name: str | None) -> None:
    """Raise ``ValueError`` naming ``tags`` for a tag MLflow or this sink would refuse at open."""
    if RUN_KEY_TAG in tags:
        raise ValueError(
            f"tags: {RUN_KEY_TAG!r} is the sink's own tag (a resumed job finds its run by it); "
            "use another tag name"
        )
    given = tags.get(_RUN_NAME_TAG)
    if given is not None and run_name is not None and given != run_name:
        raise ValueError(
            f"tags: {_RUN_NAME_TAG!r} is {given!r} but run_name is {run_name!r}; MLflow "
            "refuses a run with both: give one"
        )


_DATABASE_SCHEMES = frozenset({"sqlite", "postgresql", "mysql", "mssql"})
# How a close retries ending the run while the server is away: waits from 0.1 s doubling to
# 2 s, for at most its timeout (30 s for a close without one, as Run.close's default).
_CLOSE_RETRY_INITIAL_S = 0.1
_CLOSE_RETRY_MAX_S = 2.0
_CLOSE_RETRY_S = 30.0
_MAX_EXPERIMENT_NAME = 500
"""The longest experiment name MLflow takes."""


_MLFLOW_SCHEMES = frozenset({"http", "https", "file", "databricks", "databricks-uc", "uc"})


def _check_tracking_uri(uri: str) -> None:
    """Every check of a tracking URI that can be made before the sink opens."""
    _check_uri_scheme(uri)
    _check_server_url(uri)
    _check_file_store(uri)
    _check_database_uri(uri)
    _check_sqlite_folder(uri)


def _check_environment_uri() -> None:
    """The checks of ``tracking_uri`` for ``MLFLOW_TRACKING_URI``, which ``None`` uses.

    MLflow reads the variable only at open, on rank 0's sink thread once training has started:
    a typo there (``sqllite://``, ``http//host``, a folder not writable) would fail the sink
    for the whole job, or retry it until close, instead of failing the job's start. An empty
    variable is MLflow's default store, as unset.
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return
    try:
        _check_tracking_uri(uri)
    except ValueError as error:
        detail = str(error).removeprefix("tracking_uri: ")
        raise ValueError(
            f"tracking_uri: None uses the environment variable MLFLOW_TRACKING_URI, and {detail}"
        ) from None


def _check_uri_scheme(uri: str) -> None:
    """Raise ``ValueError`` naming ``tracking_uri`` for a scheme MLflow has no store for.

    MLflow finds out only at the first request, on rank 0's sink thread after the job started,
    and then names another problem (a file store "in maintenance mode", a model registry).
    """
    if "://***@" in uri:
        raise ValueError(
            f"tracking_uri: {uri!r} holds '***' where a password was hidden (the URI a kept "
            "spool's state names); give the URI with its password (a replay: --option "
            "tracking_uri=URI)"
        )
    if re.fullmatch(r"[\w.-]+:\d+(/.*)?", uri):
        raise ValueError(
            f"tracking_uri: {uri_without_password(uri)!r} has no scheme; a tracking server "
            f"is http://{uri} (or https://)"
        )
    scheme = urlparse(uri).scheme.lower()  # as MLflow reads it: uc:http://... is "uc"
    if len(scheme) <= 1:
        typo = re.match(r"([a-z][a-z0-9+.-]*)//", uri, re.IGNORECASE)
        known = _MLFLOW_SCHEMES | _DATABASE_SCHEMES
        if typo and typo.group(1).lower().split("+", 1)[0] in known:
            # A relative folder named "http" would be the file store: surely not meant.
            fixed = f"{typo.group(1)}:{uri[len(typo.group(1)) :]}"
            raise ValueError(
                f"tracking_uri: {uri_without_password(uri)!r} lacks the ':' after its scheme; "
                f"did you mean {uri_without_password(fixed)!r}?"
            )
        return  # a local path (a Windows one has a drive letter): MLflow's file store
    if scheme in _MLFLOW_SCHEMES or scheme.split("+", 1)[0] in _DATABASE_SCHEMES:
        return
    from importlib.metadata import entry_points

    if scheme in {entry.name for entry in entry_points(group="mlflow.tracking_store")}:
        return  # a store a plugin adds
    raise ValueError(
        f"tracking_uri: MLflow has no tracking store for the scheme {scheme!r} of "
        f"{uri_without_password(uri)!r}; expected http://host:port, https://..., "
        "sqlite:///path.db (or another database URL), databricks or file:///path (MLflow's "
        "file store, refused by MLflow 3.13 and later unless MLFLOW_ALLOW_FILE_STORE=true)"
    )


def _check_server_url(uri: str) -> None:
    """Raise ``ValueError`` naming ``tracking_uri`` for a server URL with a query or fragment.

    MLflow appends each request's path to the URI as it is, so a URL copied from the MLflow
    UI (``http://host:5000/#/experiments/1``) sent every request to the UI's page: its HTML,
    answered with 200, failed as a transient error, retried for the whole job.
    """
    parsed = urlparse(uri)
    if parsed.scheme.lower() not in ("http", "https") or not (parsed.query or parsed.fragment):
        return
    server = parsed._replace(query="", fragment="").geturl().rstrip("/")
    raise ValueError(
        f"tracking_uri: {uri_without_password(uri)!r} has a query or fragment (a URL copied "
        "from the MLflow UI?); MLflow adds its API paths to the URI as given: use the "
        f"server's URL, {uri_without_password(server)!r}"
    )


def _check_file_store(uri: str) -> None:
    """Raise ``ValueError`` naming ``tracking_uri`` for the file store where MLflow refuses it.

    MLflow 3.13 and later refuse their file store (``file:///path``, a plain path) unless
    ``MLFLOW_ALLOW_FILE_STORE`` is true, but only at the first request: on rank 0's sink thread,
    after the job started, with every report then kept for a replay.
    """
    scheme = urlparse(uri).scheme.lower()
    if scheme != "file" and (len(scheme) > 1 or uri in ("databricks", "databricks-uc")):
        return
    try:
        from mlflow.environment_variables import (  # type: ignore[import-untyped, unused-ignore]
            MLFLOW_ALLOW_FILE_STORE,
        )
    except ImportError:  # an MLflow that takes its file store as it is
        return
    if not MLFLOW_ALLOW_FILE_STORE.get():  # type: ignore[no-untyped-call, unused-ignore]
        raise ValueError(
            f"tracking_uri: {uri_without_password(uri)!r} is MLflow's file store, which this "
            "MLflow refuses unless MLFLOW_ALLOW_FILE_STORE=true is set; use a database "
            "(sqlite:///path.db) or a tracking server (http://host:port)"
        )


_SQLITE_FILE = re.compile(
    r"(sqlite(?:\+\w+)?:///)(?![/:?])([^?]+)(\?.*)?", re.IGNORECASE | re.DOTALL
)
"""A SQLite file URL with a relative path (any driver: ``sqlite+pysqlite:///rel.db``): the
scheme part, the path, then the query if any. Four slashes are an absolute path; ``:memory:``
and an empty path (``sqlite:///?timeout=5``, SQLAlchemy's in-memory database) no file."""


def _sqlite_file(uri: str) -> str | None:
    """The path of a SQLite file URL (made absolute, query left off), else ``None``.

    Decoded as SQLAlchemy decodes it (``%25`` is ``%``): the file SQLite opens.
    """
    if _SQLITE_FILE.fullmatch(uri) is None and not re.match(r"sqlite(\+\w+)?:////", uri, re.I):
        return None
    return unquote(_absolute_store(uri).split(":///", 1)[1].split("?", 1)[0])


def _absolute_store(uri: str) -> str:
    """``uri`` with a relative SQLite file or local store path made absolute."""
    relative = _SQLITE_FILE.fullmatch(uri)
    if relative is not None:
        # The query is not part of the path: made absolute with it, an empty path (in
        # memory) became the working directory itself, which SQLite cannot open.
        # The working directory goes into a URL, where SQLAlchemy decodes a '%XX' and takes
        # what follows a '?' for the query: escaped, or a job started in 'a%41b' or 'q?x'
        # opened 'aAb/mlflow.db' (a folder that is not there: retried for good) or the file
        # 'q' beside its folder. The given path is URL text already and stays as written.
        folder = os.getcwd().replace("%", "%25").replace("?", "%3F")
        path = os.path.normpath(os.path.join(folder, relative.group(2)))
        return relative.group(1) + path + (relative.group(3) or "")
    if len(urlparse(uri).scheme) <= 1 and uri not in ("databricks", "databricks-uc"):
        return os.path.abspath(uri)
    return uri


def _check_database_uri(uri: str) -> None:
    """Raise ``ValueError`` naming ``tracking_uri`` if SQLAlchemy cannot read a database URI.

    MLflow opens such a URI only at the first request, where the error would come on the
    sink's thread, after the job started. Other URIs (``http://``, a path) are left to MLflow.
    """
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower()
    if scheme not in _DATABASE_SCHEMES:
        return
    try:
        from sqlalchemy.engine import make_url
    except ImportError:  # MLflow is not installed: open says so
        return
    try:
        make_url(uri)
    except Exception:
        raise ValueError(
            f"tracking_uri: {uri_without_password(uri)!r} is not a database URL SQLAlchemy can "
            "read; a file is sqlite:///relative/path.db or sqlite:////absolute/path.db (three "
            "slashes before the path, four for an absolute one)"
        ) from None


def _check_sqlite_folder(uri: str) -> None:
    """Raise ``ValueError`` naming ``tracking_uri`` if a SQLite file's folder cannot be made.

    MLflow makes it at the first request, on rank 0's sink thread once training has started,
    where a path under a file fails for good.
    """
    path = _sqlite_file(uri)
    if path is None:
        return  # another database, or SQLite in memory
    check_name_lengths("tracking_uri", path)
    check_directory_path("tracking_uri", os.path.dirname(path) or ".")


def _make_sqlite_folder(uri: str | None) -> None:
    """Make the folder of a SQLite file URL's file, as SQLite will open it.

    MLflow makes it from the URL's text undecoded: for a folder written escaped (``a%2541b``
    for ``a%41b``) it made another one, and SQLite's open of the file then failed at every
    retry ("unable to open database file").
    """
    path = None if uri is None else _sqlite_file(uri)
    if path is not None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)


def _unreadable_database_uri(error: BaseException) -> bool:
    """Whether ``error`` is SQLAlchemy refusing the URL itself: retrying cannot help."""
    kind = type(error)
    return kind.__module__.startswith("sqlalchemy") and kind.__name__ == "ArgumentError"


def _quiet_run_urls_with_passwords() -> None:
    """Keep MLflow 2.x from printing a run's URL that holds the tracking URI's password.

    MLflow 3 reads ``MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT``, which ``_configure_http`` sets.
    MLflow 2 has no such variable. This package requires mlflow 3.9 or later, but an
    environment can hold an older one all the same (installed with ``--no-deps``): each run
    it ends prints "View run ... at: http://user:password@host/..." (logged at INFO up to 2.17,
    written to stdout from 2.18). There its ``TrackingServiceClient._log_url`` is wrapped, once,
    to print nothing for a client whose tracking URI holds user information, for the whole
    process as the variable would; other clients print as before.
    """
    try:
        from mlflow import environment_variables
        from mlflow.tracking._tracking_service.client import TrackingServiceClient
    except ImportError:
        return
    if hasattr(environment_variables, "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"):
        return  # MLflow 3: the variable is enough
    original = getattr(TrackingServiceClient, "_log_url", None)
    if original is None or getattr(original, "_sidestream_wrapper", False):
        return

    @functools.wraps(original)
    def _log_url(self: Any, run_id: str) -> None:
        uri = getattr(self, "tracking_uri", None)
        if isinstance(uri, str) and uri_without_password(uri) != uri:
            return
        original(self, run_id)

    _log_url._sidestream_wrapper = True  # type: ignore[attr-defined]
    TrackingServiceClient._log_url = _log_url  # type: ignore[method-assign, unused-ignore]


def _url_print_failed(error: BaseException) -> bool:
    """Whether ``error`` is MLflow's print of a run's URL failing (stdout closed or full).

    Its ``TrackingServiceClient._log_url`` writes to ``sys.stdout`` itself. The error comes
    from that method, or from a stdout of Python code called by it (a framework's tee); a
    network error while it reads the run comes from MLflow's or the HTTP clients' code.
    """
    if not isinstance(error, (OSError, ValueError, AttributeError)):
        return False
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_name != "_log_url":
        tb = tb.tb_next
    if tb is None:
        return False
    tb = tb.tb_next
    while tb is not None:
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        if module.split(".")[0] in ("mlflow", "requests", "urllib3", "http", "socket"):
            return False
        tb = tb.tb_next
    return True


def _error_chain(error: BaseException) -> list[BaseException]:
    """``error`` and the errors it was raised from or while handling, outermost first.

    MLflow raises its ``MlflowException`` inside the ``except`` of the HTTP client's error,
    so the TLS error it wraps is that exception's context.
    """
    chain: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and link not in chain and len(chain) < 16:
        chain.append(link)
        link = link.__cause__ or link.__context__
    return chain


def _ended_on_server(client: Any, run_id: str, status: str) -> bool:
    try:
        return bool(client.get_run(run_id).info.status == status)
    except Exception:
        return False


def _key(name: str) -> str:
    """The MLflow key of ``name``: itself if MLflow takes it, else a valid key of its own.

    MLflow refuses characters outside its set and names that are not normal relative paths
    (``/lr``, ``lr/``, ``a//b``, ``a/./b``, ``..x``): one such value would fail every request
    it rides in. A changed name gets a digest of the original, so two names that clean to the
    same text (``acc@1``, ``acc#1``) stay two series instead of one with two values per step.
    """
    cleaned = _NOT_ALLOWED_IN_KEY.sub("_", name)
    segments = ["_" if part in ("", ".", "..") else part for part in cleaned.split("/")]
    cleaned = "/".join(segments)
    if cleaned.startswith(".."):
        cleaned = "_" + cleaned[1:]
    if cleaned != name:
        cleaned = f"{cleaned}-{name_digest(name)}"
    return shorten(cleaned, MAX_KEY_LENGTH)
