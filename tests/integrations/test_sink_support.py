from __future__ import annotations

import pytest

from sidestream.sinks.support import (
    HistogramEdges,
    checked_histogram_edges,
    flatten_config,
    histogram_edges,
    redact,
    secrets_in,
    shorten,
    silence_thread_errors,
    uri_without_password,
)


def test_flatten_config_joins_keys_and_stringifies_what_the_backend_cannot_take() -> None:
    marker = object()
    config = {"opt": {"lr": 0.1, "betas": [0.9, 0.95], "sched": {"warmup": 10}}, "x": marker}
    assert flatten_config(config) == {
        "opt.lr": 0.1,
        "opt.betas": "[0.9, 0.95]",
        "opt.sched.warmup": 10,
        "x": str(marker),
    }
    assert flatten_config({"a": {"b": 1, "c": None}}, separator="/", plain_types=()) == {
        "a/b": "1",
        "a/c": "None",
    }


def test_numpy_scalars_and_zero_dim_tensors_in_a_config_are_numbers() -> None:
    # They were kept as text: W&B showed '2.5', '32' and 'tensor(0.1000)'.
    import numpy as np
    import torch

    config = {
        "lr": np.float32(2.5),
        "eps": np.float32(3e-4),  # as written: not float32's exact 0.0003000000142492354
        "wd32": torch.tensor(1e-4),
        "batch": np.int64(32),
        "wd": torch.tensor(0.25, dtype=torch.float64),
        "flags": {"amp": np.bool_(True), "steps": torch.tensor(7)},
        "betas": torch.tensor([0.9, 0.95]),  # not one number: text, as a list is
    }
    with np.printoptions(legacy="1.13"):  # numpy's printing must not decide the number
        assert flatten_config({"x": np.float32(0.123456789)}) == {"x": 0.12345679}
    flat = flatten_config(config)
    assert flat == {
        "lr": 2.5,
        "eps": 3e-4,
        "wd32": 1e-4,
        "batch": 32,
        "wd": 0.25,
        "flags.amp": True,
        "flags.steps": 7,
        "betas": str(config["betas"]),
    }
    assert [type(flat[k]) for k in ("lr", "batch", "wd", "flags.amp", "flags.steps")] == [
        float,
        int,
        float,
        bool,
        int,
    ]


def test_two_config_entries_of_one_flattened_name_are_refused_when_the_run_is_made() -> None:
    # {"opt.lr": 0.1, "opt": {"lr": 0.2}} became one parameter opt.lr = 0.2: 0.1 was lost with
    # no word, on rank 0's sink thread.
    from sidestream.sinks import RunInfo

    config = {"opt.lr": 0.1, "opt": {"lr": 0.2}}
    message = r"config\['opt.lr'\] and config\['opt'\]\['lr'\] both become 'opt.lr'"
    with pytest.raises(ValueError, match=message):
        flatten_config(config)
    with pytest.raises(ValueError, match=message):
        RunInfo(config=config)
    RunInfo(config={"opt": {"lr": 0.2}, "opt.wd": 0.1})  # distinct names are fine


def test_shorten_keeps_the_limit_and_keeps_long_names_distinct() -> None:
    assert shorten("short", 250) == "short"
    a, b = shorten("x" * 300 + "a", 250), shorten("x" * 300 + "b", 250)
    assert len(a) == len(b) == 250 and a != b
    assert shorten("x" * 300 + "a", 250) == a  # deterministic


def test_credentials_are_removed_from_uris_and_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    uri = "https://alice:s3cret-pass@mlflow.example.com:8443/path"
    assert uri_without_password(uri) == "https://***@mlflow.example.com:8443/path"
    assert uri_without_password("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    monkeypatch.setenv("SOME_TOKEN", "tok-123456")
    secrets = secrets_in(["SOME_TOKEN", "UNSET_VARIABLE"], [uri])
    message = f"failed {uri} with tok-123456; headers={{'Authorization': 'Bearer abcdef'}}"
    cleaned = redact(message, secrets)
    for secret in ("s3cret-pass", "tok-123456", "abcdef"):
        assert secret not in cleaned
    # A URI that does not parse (a port that is not a number) is redacted too: the message
    # that says it is wrong used to fail with urllib's own error instead.
    broken = "postgresql://bob:p@ss-word@db.example.com:notaport/runs"
    assert uri_without_password(broken) == "postgresql://***@db.example.com:notaport/runs"
    assert {"p@ss-word"} <= set(secrets_in([], [broken]))
    # SQLAlchemy takes a password with "/" or "#" unencoded: no "@" before them, yet secret.
    slashed = "postgresql://bob:pa/ss#word@db.example.com/runs"
    assert uri_without_password(slashed) == "postgresql://***@db.example.com/runs"
    assert {"pa/ss#word"} <= set(secrets_in([], [slashed]))
    for plain in ("http://host:5000/a@b", "file:///a@b", "http://h/x?u=a:b@c"):
        assert uri_without_password(plain) == plain  # an "@" in the path or query
    assert uri_without_password("http://alice@Host/a@b") == "http://***@Host/a@b"


def test_histogram_edges_default_to_unit_bins_and_check_given_ones() -> None:
    assert histogram_edges(3, None) == [0.0, 1.0, 2.0, 3.0]
    assert histogram_edges(2, [0, 0.5, 1]) == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="expected 3 finite increasing edges"):
        histogram_edges(2, [0, 1])
    with pytest.raises(ValueError, match="increasing"):
        histogram_edges(2, [0, 1, 1])
    # NaN compares false both ways: an order check alone let it through.
    for edges in ([0, float("nan"), 2], [0, 1, float("inf")]):
        with pytest.raises(ValueError, match="finite increasing"):
            histogram_edges(2, edges)
        with pytest.raises(ValueError, match=r"histogram_edges\['h'\]: .*finite increasing"):
            checked_histogram_edges({"h": edges})


def test_histogram_edges_keys_that_match_no_histogram_are_named() -> None:
    warned: list[tuple[str, str]] = []

    def warn_once(key: str, message: str) -> None:
        warned.append((key, message))

    edges = HistogramEdges({"scores": [0, 0.5, 1], "val/score": [0, 1], "val/x": [0, 1]}, "S")
    # The prefix left out: said at the first histogram it would have matched, once per name.
    assert edges.edges("train/scores", 2, warn_once) == [0.0, 1.0, 2.0]
    assert len(warned) == 1
    key, message = warned[0]
    assert key == "histogram_edges:train/scores"
    assert message == (
        "S: histogram 'train/scores' has no histogram_edges entry, so its bins are drawn as "
        "[i, i + 1); the option has 'scores': its keys are the names as reported, with the "
        "stream's prefix ('train/scores')"
    )
    assert edges.edges("val/x", 1, warn_once) == [0.0, 1.0]  # matched: used, no warning
    edges.edges("val/scores", 2, warn_once)  # a typo is no suffix: named at close only
    assert edges.unmatched_warning() == (
        "S: histogram_edges 'scores' (did you mean 'train/scores' or 'val/scores'?), "
        "'val/score' (did you mean "
        "'val/scores'?) matched no histogram of this run (histograms without edges: "
        "'train/scores', 'val/scores'); keys are the names as reported, with the stream's "
        "prefix (such as 'train/scores')"
    )
    assert HistogramEdges({"h": [0, 1]}, "S").unmatched_warning() == (
        "S: histogram_edges 'h' matched no histogram of this run (it wrote no histogram); keys "
        "are the names as reported, with the stream's prefix (such as 'train/scores')"
    )
    every = HistogramEdges({"a/h": [0, 1]}, "S")
    every.edges("a/h", 1, warn_once)
    assert every.unmatched_warning() is None
    # One key used, another not: the run did write a histogram ("it wrote no histogram" said).
    partly = HistogramEdges({"a/h": [0, 1], "a/g": [0, 1]}, "S")
    partly.edges("a/h", 1, warn_once)
    assert partly.unmatched_warning() == (
        "S: histogram_edges 'a/g' matched no histogram of this run (every histogram it wrote "
        "had edges); keys are the names as reported, with the stream's prefix (such as "
        "'train/scores')"
    )
    assert HistogramEdges(None, "S").unmatched_warning() is None


def test_silenced_thread_errors_pass_other_threads_on_to_a_hook_set_later_without_a_cycle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A hook set after the first call, then a second call, made the two hooks call each other
    # for every other thread's error until RecursionError.
    import threading

    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(
        threading, "excepthook", lambda args: seen.append(("base", args.thread.name))
    )

    def is_quiet(thread: threading.Thread) -> bool:
        return thread.name == "sidestream-test-quiet"

    silence_thread_errors(is_quiet)
    below = threading.excepthook

    def users_hook(args: threading.ExceptHookArgs) -> None:
        seen.append(("user", args.thread.name))
        below(args)

    monkeypatch.setattr(threading, "excepthook", users_hook)
    silence_thread_errors(is_quiet)
    for name in ("sidestream-test-quiet", "sidestream-test-loud"):
        thread = threading.Thread(target=lambda: 1 / 0, name=name)
        thread.start()
        thread.join()
    assert seen == [("user", "sidestream-test-loud"), ("base", "sidestream-test-loud")]
