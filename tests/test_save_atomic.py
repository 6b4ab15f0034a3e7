"""No checkpoint lost on save (jaxattn.models._checkpoint_swap, jaxattn._atomic_files).

A tiny Llama (tests/_save_atomic_child.py: ~13 KB of float32, max_shard_size small so there are several
shards) is saved with its "old" weights into a directory that also holds a README, then saved again with
"new" weights, and the second save is made to fail:
  * an OSError (ENOSPC), or a KeyboardInterrupt, raised at each file event in turn (every write, rename,
    link of the save): the save raises it, and the directory is exactly as it was (every name and byte)
    with no temporary file left;
  * a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) below the checkpoint's size, in a subprocess: EFBIG,
    and the directory as it was;
  * a SIGKILL right after the k-th file event, in a subprocess: the directory may hold hidden files, and
    the next save removes them.
After each, both readers load the old tensors or the new ones, bit for bit, never a mix and never an
error: from_pretrained (which takes the index first) and transformers' choice (model.safetensors first,
read here with load_safetensors, no torch). The old -> new layouts: shards over shards of the same count
(whose names the new set takes), one file over shards and shards over one file; a new shard count.
"""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _save_atomic_child import EVENTS, tiny_llama

from jaxattn import _atomic_files
from jaxattn.io import load_safetensors, save_safetensors
from jaxattn.models import from_pretrained, to_pretrained

USERS_HIDDEN = ".notes.tmp-0123abcd"
CHILD = os.path.join(os.path.dirname(__file__), "_save_atomic_child.py")
LIMIT = 2000  # bytes per shard: 7 shards
# (old max_shard_size, new max_shard_size): None is one file
LAYOUTS = {
    "same-count": (LIMIT, LIMIT),
    "one-over-shards": (LIMIT, None),
    "shards-over-one": (None, LIMIT),
    "new-count": (LIMIT, 3 * LIMIT),
    "same-count-3": (3 * LIMIT, 3 * LIMIT),
}


@pytest.fixture(scope="module")
def llamas():
    """{"old": (model, params), "new": (model, params)}: the same tiny Llama, two sets of weights."""
    return {"old": tiny_llama(0), "new": tiny_llama(1)}


@pytest.fixture(scope="module")
def expected(llamas, tmp_path_factory):
    """{"old"/"new": {HF name: array}}: what each save writes, read back from a directory of its own."""
    out = {}
    for which, (model, params) in llamas.items():
        directory = to_pretrained(model, params, tmp_path_factory.mktemp(which))
        out[which] = load_safetensors(directory / "model.safetensors")
    return out


def old_directory(llamas, directory: Path, old_limit) -> Path:
    directory.mkdir()
    (directory / "README.md").write_text("the user's own file\n")
    (directory / USERS_HIDDEN).write_text("hidden, with a temporary-looking name, but not a checkpoint's\n")
    model, params = llamas["old"]
    return to_pretrained(model, params, directory, max_shard_size=old_limit)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def transformers_choice(directory: Path) -> dict[str, np.ndarray]:
    """The tensors transformers would load: model.safetensors if there is one, else the index's shards."""
    if (directory / "model.safetensors").is_file():
        return load_safetensors(directory / "model.safetensors")
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for file in sorted(set(weight_map.values())):
        tensors.update(load_safetensors(directory / file))
    return tensors


def params_as_tensors(llamas, params) -> dict:
    """from_pretrained's params as {HF name: array} (the table read backwards), to compare with a save."""
    from jaxattn.models import _save, weights

    model = llamas["old"][0]
    _, rows, dims = _save._WRITERS[type(model)](model)
    return weights.unfill(params, rows, dims)


def which_set(tensors: dict, expected: dict) -> str:
    """ "old" or "new": the set `tensors` equals bit for bit (AssertionError on a mix or anything else)."""
    for which, want in expected.items():
        if tensors.keys() == want.keys() and all(
            tensors[k].dtype == want[k].dtype and tensors[k].tobytes() == want[k].tobytes() for k in want
        ):
            return which
    raise AssertionError("the directory holds neither the old nor the new tensors")


def assert_loads_old_or_new(directory: Path, llamas, expected, *, want: str | None = None) -> str:
    _, params = from_pretrained(directory)
    ours = which_set(params_as_tensors(llamas, params), expected)
    theirs = which_set(transformers_choice(directory), expected)
    assert (directory / "README.md").read_text() == "the user's own file\n" and (directory / USERS_HIDDEN).is_file()
    for got in (ours, theirs):
        assert want is None or got == want, (got, want)
    return ours


def hidden_files(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(".") and p.name != USERS_HIDDEN]


def count_events(monkeypatch, run) -> int:
    """How many file events (jaxattn._atomic_files: writes, renames, links, unlinks) run() makes."""
    with monkeypatch.context() as patch:
        count = [0]
        for name in EVENTS:
            real = getattr(_atomic_files, name)
            patch.setattr(
                _atomic_files, name, lambda *a, _real=real, **k: (count.__setitem__(0, count[0] + 1), _real(*a, **k))[1]
            )
        run()
    return count[0]


# --- an exception at each file event in turn ----------------------------------------------------------------


def events_of_a_save(llamas, tmp_path, monkeypatch, layout) -> int:
    old_limit, new_limit = LAYOUTS[layout]
    directory = old_directory(llamas, tmp_path / "counted", old_limit)
    model, params = llamas["new"]
    return count_events(monkeypatch, lambda: to_pretrained(model, params, directory, max_shard_size=new_limit))


def fail_at(patch, k: int, error: BaseException) -> None:
    """The k-th file event from now raises `error` instead of running."""
    count = [0]

    def make(real):
        def event(*args, **kwargs):
            count[0] += 1
            if count[0] == k:
                raise error
            return real(*args, **kwargs)

        return event

    for name in EVENTS:
        patch.setattr(_atomic_files, name, make(getattr(_atomic_files, name)))


def _fail_at_every_event(llamas, expected, tmp_path, monkeypatch, layout, error):
    old_limit, new_limit = LAYOUTS[layout]
    model, params = llamas["new"]
    reference = old_directory(llamas, tmp_path / "reference", old_limit)
    before = snapshot(reference)
    events = events_of_a_save(llamas, tmp_path, monkeypatch, layout)
    assert events > 20, events  # every file written, renamed and linked: many chances to fail
    outcomes = []
    for k in range(1, events + 1):
        directory = Path(shutil.copytree(reference, tmp_path / f"at-{k}"))
        with monkeypatch.context() as patch:
            fail_at(patch, k, error)
            try:
                to_pretrained(model, params, directory, max_shard_size=new_limit)
                raised = False
            except type(error):
                raised = True
        loaded = assert_loads_old_or_new(directory, llamas, expected)
        outcomes.append(loaded)
        if loaded == "old":  # a failed save: exactly as it was, no name or byte changed, no debris
            assert raised and snapshot(directory) == before, k
        else:  # failed after the switch, removing leftovers: complete; what is left, the next save removes
            assert isinstance(error, KeyboardInterrupt) or not raised, k
            if outcomes.count("new") == 1:
                to_pretrained(model, params, directory, max_shard_size=new_limit)
                assert hidden_files(directory) == []
    # every event before the switch fails the save; only the removal of leftovers after it does not
    switched = outcomes.index("new")
    assert outcomes == ["old"] * switched + ["new"] * (events - switched) and switched > events // 2, outcomes


def test_an_oserror_at_each_file_event_leaves_the_directory_as_it_was(llamas, expected, tmp_path, monkeypatch):
    """ENOSPC at every write / rename / link of a save of 3 shards over 3 shards (the layout whose new names
    are the old ones); 7 shards and the other layouts in the slow group."""
    _fail_at_every_event(llamas, expected, tmp_path, monkeypatch, "same-count-3", OSError(errno.ENOSPC, "full"))


@pytest.mark.slow  # ~100 saves per layout
@pytest.mark.parametrize("layout", ["same-count", "one-over-shards", "shards-over-one", "new-count"])
@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "full"), KeyboardInterrupt()], ids=["ENOSPC", "interrupt"])
def test_an_error_at_each_file_event_in_every_layout(llamas, expected, tmp_path, monkeypatch, layout, error):
    _fail_at_every_event(llamas, expected, tmp_path, monkeypatch, layout, error)


@pytest.mark.parametrize("layout", list(LAYOUTS)[:4])
def test_a_completed_save_replaces_the_set_and_leaves_no_debris(llamas, expected, tmp_path, layout):
    old_limit, new_limit = LAYOUTS[layout]
    directory = old_directory(llamas, tmp_path / "d", old_limit)
    model, params = llamas["new"]
    to_pretrained(model, params, directory, max_shard_size=new_limit)
    assert_loads_old_or_new(directory, llamas, expected, want="new")
    assert hidden_files(directory) == []
    weights = sorted(p.name for p in directory.iterdir() if p.name.startswith("model"))
    index = json.loads((directory / "model.safetensors.index.json").read_text()) if new_limit else None
    want = (
        ["model.safetensors"]
        if index is None
        else sorted({*index["weight_map"].values(), "model.safetensors.index.json"})
    )
    assert weights == want  # the old set's other files (old shards, the other kind's file) are gone


def test_a_bad_leaf_found_late_writes_nothing(llamas, expected, tmp_path):
    """A tensor the format cannot hold in the last shard: ValueError, and no file of the directory changed."""
    directory = old_directory(llamas, tmp_path / "d", LIMIT)
    before = snapshot(directory)
    model, params = llamas["new"]
    bad = {**params, "lm_head": {"kernel": np.asarray(params["lm_head"]["kernel"], np.complex128)}}
    with pytest.raises(ValueError, match=r"tensors\['lm_head.weight'\]: expected one of the safetensors dtypes"):
        to_pretrained(model, bad, directory, max_shard_size=LIMIT)
    assert snapshot(directory) == before


def test_a_failed_save_into_a_new_directory_leaves_nothing(llamas, tmp_path, monkeypatch):
    model, params = llamas["new"]
    monkeypatch.setattr(_atomic_files, "replace", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "io")))
    with pytest.raises(OSError):
        to_pretrained(model, params, tmp_path / "new" / "deeper", max_shard_size=LIMIT)
    assert list(tmp_path.iterdir()) == []


def test_save_safetensors_replaces_a_file_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "x.safetensors"
    save_safetensors({"x": np.arange(7, dtype=np.float32)}, path)
    before = path.read_bytes()
    monkeypatch.setattr(_atomic_files, "write_all", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(OSError, match="full"):
        save_safetensors({"x": np.arange(11, dtype=np.float32)}, path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]


# --- subprocesses: a file-size limit, and SIGKILL -------------------------------------------------------------


def run_child(old, work, new_limit, *tasks) -> dict[str, str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, CHILD, str(old), str(work), str(new_limit).lower(), *tasks],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _in_subprocess(llamas, expected, tmp_path, layout, tasks) -> tuple[set[str], dict[str, str]]:
    """Run the child's tasks ("kill:K", "fsize:BYTES") on copies of an old directory; check each copy, then
    that the next save over it completes and leaves no hidden file. ({"old"/"new": the sets the copies
    held}, the child's results)."""
    old_limit, new_limit = LAYOUTS[layout]
    old = old_directory(llamas, tmp_path / "old", old_limit)
    before = snapshot(old)
    model, params = llamas["new"]
    (tmp_path / "work").mkdir()
    results = run_child(old, tmp_path / "work", new_limit, *tasks)
    seen = set()
    for task in tasks:
        directory = tmp_path / "work" / task.replace(":", "-")
        kind = task.split(":")[0]
        if kind == "fsize":  # a write that crosses the limit raises EFBIG: the save fails, nothing changed
            assert results[task] in (f"OSError {errno.EFBIG}", "saved"), results
            assert results[task] == "saved" or snapshot(directory) == before, task
        else:
            assert results[task] in ("killed", "saved"), results
        seen.add(assert_loads_old_or_new(directory, llamas, expected))
        to_pretrained(model, params, directory, max_shard_size=new_limit)  # the next save cleans up
        assert hidden_files(directory) == []
        assert_loads_old_or_new(directory, llamas, expected, want="new")
    return seen, results


@pytest.mark.slow  # child processes killed mid-save: 3 s
def test_a_killed_or_size_limited_save_leaves_the_old_or_the_new_set(llamas, expected, tmp_path):
    """One subprocess: SIGKILL right after a shard's write (before the switch) and after the switch's last
    rename; RLIMIT_FSIZE below one shard (the first shard's write fails with EFBIG)."""
    seen, results = _in_subprocess(llamas, expected, tmp_path, "same-count", ["kill:3", "kill:60", "fsize:1500"])
    assert seen == {"old", "new"} and results == {
        "kill:3": "killed",
        "kill:60": "killed",
        "fsize:1500": f"OSError {errno.EFBIG}",
    }


@pytest.mark.slow  # one fork per event (every third in the layouts other than same-count)
@pytest.mark.parametrize("layout", list(LAYOUTS)[:4])
def test_a_sigkill_after_every_file_event(llamas, expected, tmp_path, monkeypatch, layout):
    events = events_of_a_save(llamas, tmp_path, monkeypatch, layout)
    limits = [f"fsize:{n}" for n in (100, 1500, 5000, 9000)]  # in the header, in a shard, in the single file
    every = 1 if layout == "same-count" else 3  # fewer forks: the exception tests above visit every step
    seen, results = _in_subprocess(
        llamas, expected, tmp_path, layout, [f"kill:{k}" for k in range(1, events + 1, every)] + limits
    )
    assert seen == {"old", "new"} and f"OSError {errno.EFBIG}" in results.values()
