"""A checkpoint directory's files replaced so that no save, failed or killed, loses the checkpoint.

    swap_in(directory, {"config.json": write, "model-00001-of-00002.safetensors": write, ...})

The set of files to_pretrained owns in a directory: config.json, and model.safetensors or the index
model.safetensors.index.json with the shards it lists. Everything else (README, tokenizer files) is the
user's and is never touched. The two readers choose differently: jaxattn's from_pretrained takes the index
if there is one, transformers takes model.safetensors if there is one; each then reads only the files it
names. So a file no reader chooses can be written, renamed or removed without any reader noticing, and a
reader switches from the old set to the new one at the one rename (or unlink) that changes its choice.

The steps, each a single rename, link or unlink (atomic on POSIX), in this order:

1. Debris of a killed save goes: hidden names of the checkpoint's files (".<name>.tmp-<hex>",
   ".<name>.old-<hex>") that the current index does not list.
2. Every new file is written whole under a hidden temporary name in the directory (same filesystem, so
   the renames below are atomic), and fsynced, and so is the directory. A failure here (a full disk, a
   file-size limit, an interrupt, a bad tensor found late) removes the temporary files; nothing else has
   changed.
3. When the new shards have the names of the current index's shards (the same shard count), the old
   shards get second, hidden names (hard links: no bytes copied) and the index is rewritten to list
   those: still the complete old set, and the shard names are free.
4. The new shards are renamed to their names: no reader chooses them yet.
5. config.json is renamed in (only its content can change here: when it does, a reader starting in the
   instant between steps 5 and 6 reads the new config with the old weights).
6. The switch: the new index renamed in (jaxattn switches), then an old model.safetensors unlinked
   (transformers switches); or the new model.safetensors renamed in (transformers switches, and jaxattn
   when there is no index), then an old index unlinked (jaxattn switches). The directory is fsynced.
7. The old set's leftovers (shards the new set lacks, the hidden old names) are removed; one that cannot
   be (an error, an interrupt) stays for the next save's step 1: the save itself is complete.

At every instant each reader finds a complete set, the old one before its switch and the new one after.
An exception before the switch is complete undoes steps 3-6 in reverse order (so every instant of the
undo is consistent too) and removes the temporary files: the directory is as it was, byte for byte. A
SIGKILL leaves at worst hidden files no reader takes (or, between steps 3 and 6, the old set under the
hidden names its index lists); the next save removes them (step 1, and step 7). Two saves into one
directory at the same time are not supported. Without hard links (some network or FAT filesystems) the
old files kept for an undo are copies.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from .. import _atomic_files as atomic_files

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def swap_in(directory: Path, files: Mapping[str, Callable[[int], None]]) -> None:
    """Replace the checkpoint files of `directory` (which exists) by `files` ({name: write(fd)}: config.json,
    and model.safetensors or the index and its shards), in the steps of the module docstring."""
    swap = _Swap(directory)
    swap.remove_debris()
    try:
        temps = swap.write_all(files)
        swap.switch(temps)
    except BaseException:
        swap.undo()
        raise
    swap.remove_leftovers(set(files))


def listed_files(directory: Path) -> dict[str, str] | None:
    """The index's weight_map ({tensor: file}), or None without an index or with one that is not valid."""
    try:
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return weight_map if isinstance(weight_map, dict) else None


class _Swap:
    """One save's steps, and how to undo those done so far."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.undo_steps: list[Callable[[], None]] = []
        self.temps: list[Path] = []  # hidden files this save made: removed at the end, whatever happens

    def path(self, name: str) -> Path:
        return self.directory / name

    def remove_debris(self) -> None:
        listed = set((listed_files(self.directory) or {}).values())
        for file in self.directory.iterdir():
            if _ours(atomic_files.hidden_for(file.name)) and file.name not in listed and file.is_file():
                atomic_files.remove(file)

    def write_all(self, files) -> dict[str, Path]:
        temps = {}
        for name, write in files.items():
            temps[name] = atomic_files.write_temp(self.path(name), write)
            self.temps.append(temps[name])
        atomic_files.fsync_directory(self.directory)
        return temps

    def keep(self, name: str) -> Path:
        """A hidden second name for the existing file `name` (kept for an undo)."""
        kept = atomic_files.keep(self.path(name))
        self.temps.append(kept)
        return kept

    def put(self, temp: Path, name: str) -> None:
        """Rename temp to name, undoably: the file it replaces, if any, is kept and comes back on undo."""
        target = self.path(name)
        kept = self.keep(name) if target.exists() else None
        atomic_files.replace(temp, target)
        self.undo_steps.append(lambda: self.restore(kept, target))

    def drop(self, name: str) -> None:
        """Unlink name if it exists, undoably."""
        target = self.path(name)
        if target.exists():
            kept = self.keep(name)
            atomic_files.remove(target)
            self.undo_steps.append(lambda: self.restore(kept, target))

    def restore(self, kept: Path | None, target: Path) -> None:
        if kept is None:
            atomic_files.remove(target)
        else:  # a new link renamed over target, so `kept` stays listed where an index lists it
            atomic_files.replace(atomic_files.keep(kept), target)

    def switch(self, temps: dict[str, Path]) -> None:
        new = set(temps)
        sharded = INDEX in new
        old_map = listed_files(self.directory)
        if sharded and old_map and new & set(old_map.values()):  # step 3: free the names the new shards take
            hidden = {f: self.keep(f).name for f in sorted(set(old_map.values()) & new)}
            index = json.loads(self.path(INDEX).read_text())
            index["weight_map"] = {k: hidden.get(f, f) for k, f in old_map.items()}
            moved = atomic_files.write_bytes_temp(self.path(INDEX), _json_bytes(index))
            self.temps.append(moved)
            self.put(moved, INDEX)
        shards = sorted(new - {CONFIG, INDEX, SINGLE})
        for name in shards:  # step 4
            self.put(temps[name], name)
        self.put(temps[CONFIG], CONFIG)  # step 5
        if sharded:  # step 6
            self.put(temps[INDEX], INDEX)
            self.drop(SINGLE)
        else:
            self.put(temps[SINGLE], SINGLE)
            self.drop(INDEX)
        atomic_files.fsync_directory(self.directory)

    def undo(self) -> None:
        for step in reversed(self.undo_steps):
            step()
        self.remove_temps()
        atomic_files.fsync_directory(self.directory)

    def remove_temps(self) -> None:
        for temp in self.temps:
            atomic_files.remove(temp)

    def remove_leftovers(self, new: set[str]) -> None:
        """Step 7: shards of another save and every hidden file of ours (nothing lists them now). The new set
        is in place: a file that cannot be removed stays for the next save (step 1) rather than fail this one."""
        leftovers = [
            *self.temps,
            *(
                file
                for file in self.directory.iterdir()
                if file.name not in new
                and (
                    file.name in (SINGLE, INDEX)
                    or SHARD.fullmatch(file.name)
                    or _ours(atomic_files.hidden_for(file.name))
                )
            ),
        ]
        for file in leftovers:
            try:
                atomic_files.remove(file)
            except OSError:
                pass


def _ours(name: str | None) -> bool:
    """Whether a (hidden file's) name is one of the checkpoint's: the user's own files are never removed."""
    return name is not None and (name in (CONFIG, SINGLE, INDEX) or SHARD.fullmatch(name) is not None)


def _json_bytes(value) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()
