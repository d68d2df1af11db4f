"""The persistent executable cache: compiled programs on disk, so that a second process (or a
program evicted from memory) starts without tracing or compiling.

Where (each executor follows its own options): ``Options.enableExecutableCaching(path)`` caches in
``path``, ``enableExecutableCaching(None)`` not at all; left at its default (``"auto"``) it is
``$IPU_BACKEND_CACHE_DIR`` when set (``off`` turns caching off), else PopTorch's
``$POPTORCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/ipu_backend``, else ``~/.cache/ipu_backend``.

An entry's key is a digest of the program's key in the process (the capture's identity, the
options that change the program, the optimizer's structure, the inputs, the lowering options;
see :mod:`~ipu_backend.runtime.program_cache`) and of what compiled it: this package's source,
the torch, JAX, jaxlib and Python versions, the backend, its device kind and count, and the XLA
flags. A program whose key has no stable description is not cached. An entry holds the XLA
executable, its argument and result structures and the program's output layout (a stage program
of a model split over IPUs: its devices; its key adds the fingerprint of its lowered program); it is read
only by this package, from the user's own directory (it is a pickle, as JAX's cache entries are).
The directory also keeps the captures' decompositions to core ATen (:class:`Decompositions`), so
that a second process exports its model but does not decompose it again.

The directory is bounded (``$IPU_BACKEND_CACHE_SIZE_MB``, 1024 MiB unless set): after each
write the least recently used entries (by modification time, which a read renews) are removed
until it fits.
"""

import functools
import hashlib
import logging
import os
import pathlib
import pickle
import platform
import tempfile

import jax
import jaxlib
import torch

from ipu_backend.compiler.capture import without_treespec_deprecation
from ipu_backend.compiler.identity import Unidentifiable, describe
from ipu_backend.errors import Error
from ipu_backend.runtime import serialization, xla_compile
from ipu_backend.runtime.settings import AUTO_CACHE_DIR

logger = logging.getLogger("ipu_backend")

DIRECTORY_VARIABLE = "IPU_BACKEND_CACHE_DIR"
POPTORCH_VARIABLE = "POPTORCH_CACHE_DIR"
"""PopTorch's variable: caching for every model that does not set its own path."""
OFF = "off"
"""The value of ``$IPU_BACKEND_CACHE_DIR`` that turns caching off."""
SIZE_VARIABLE = "IPU_BACKEND_CACHE_SIZE_MB"
DEFAULT_SIZE_MB = 1024
SUFFIX = ".ipu-executable"
DECOMPOSITION_SUFFIX = ".ipu-decomposition"
"""Entries of ``compiler.decomposition_cache``: captures decomposed to core ATen."""
FORMAT = 1


def directory(setting: str | None) -> str | None:
    """The directory an executor with this ``executable_cache_dir`` setting caches in, or None."""
    if setting is None:
        return None
    if setting != AUTO_CACHE_DIR:
        return setting
    from_environment = os.environ.get(DIRECTORY_VARIABLE, "") or os.environ.get(POPTORCH_VARIABLE, "")
    if from_environment.strip().lower() == OFF:
        return None
    if from_environment:
        return from_environment
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ipu_backend")


def size_limit() -> int:
    """The directory's bound in bytes."""
    text = os.environ.get(SIZE_VARIABLE, "")
    if not text:
        return DEFAULT_SIZE_MB * 2**20
    if not text.isdigit():
        raise Error(f"{SIZE_VARIABLE}={text!r}: give the cache's size in MiB (a whole number)")
    return int(text) * 2**20


@functools.cache
def _source_digest() -> str:
    """A digest of this package's Python source: a changed program builder is another key."""
    root = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def environment() -> tuple:
    """What compiled a program besides its key: source, versions, backend and flags."""
    devices = jax.devices()
    return (_source_digest(), torch.__version__, jax.__version__, jaxlib.__version__, platform.python_version(),
            jax.default_backend(), devices[0].device_kind, devices[0].client.platform_version, len(devices),
            os.environ.get("XLA_FLAGS", ""), jax.config.jax_enable_x64, str(jax.config.jax_default_matmul_precision))


def entry_key(program_key: tuple) -> str | None:
    """The file name stem of a program's entry, or None when its key has no stable description."""
    try:
        text = describe((program_key, environment()))
    except Unidentifiable:
        return None
    return hashlib.sha256(text.encode()).hexdigest()


class ExecutableCache:
    """Entries in ``root`` (made when first written), bounded to ``limit`` bytes."""

    def __init__(self, root: str, limit: int | None = None):
        self.root = root
        self.limit = size_limit() if limit is None else limit

    def _path(self, key: str, suffix: str = SUFFIX) -> str:
        return os.path.join(self.root, key + suffix)

    def holds(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def load(self, key: str, devices):
        """``(executable, layout state)`` stored under ``key``, loaded onto ``devices`` (a list, or
        a function of the layout state giving it), or None."""
        path = self._path(key)
        data = self.read(key, SUFFIX)
        if data is None:
            return None
        try:
            with without_treespec_deprecation():
                entry = pickle.loads(data)
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError) as error:
            logger.warning("ignoring the unreadable executable cache entry %s (%s)", path, error)
            return None
        if not isinstance(entry, dict) or entry.get("format") != FORMAT:
            return None
        if callable(devices):
            devices = devices(entry["layout"])
        try:
            executable = serialization.deserialized(entry["executable"], entry["in_tree"], entry["out_tree"], devices)
        except (jax.errors.JaxRuntimeError, ValueError) as error:
            logger.warning("compiling again: the cached executable %s does not load (%s)", path, error)
            return None
        return executable, entry["layout"]

    def store(self, key: str, executable, layout_state) -> None:
        """Write ``executable`` (and the program's output layout) under ``key``, then keep the
        directory within its bound. A program XLA cannot serialize is left out."""
        try:
            payload, in_tree, out_tree = serialization.serialized(executable)
        except serialization.Unserializable as error:
            logger.info("not caching a program on disk: %s", error)
            return
        try:
            data = pickle.dumps({"format": FORMAT, "executable": payload, "in_tree": in_tree, "out_tree": out_tree,
                                 "layout": layout_state}, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            logger.info("not caching a program on disk: its outputs do not pickle (%s)", error)
            return
        self.write(key, data, SUFFIX)

    def read(self, key: str, suffix: str) -> bytes | None:
        """The bytes of the entry ``key`` with ``suffix``, or None (a read renews the entry)."""
        path = self._path(key, suffix)
        try:
            with open(path, "rb") as file:
                data = file.read()
            os.utime(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as error:
            logger.warning("ignoring the unreadable cache entry %s (%s)", path, error)
            return None
        return data

    def write(self, key: str, data: bytes, suffix: str) -> None:
        """``data`` as the entry ``key`` with ``suffix``, then the directory kept within its bound;
        a directory that cannot be written is warned of."""
        try:
            self._write(self._path(key, suffix), data)
            self.evict()
        except OSError as error:
            logger.warning("not caching a program on disk: the executable cache %s cannot be written (%s); "
                           "move it with $%s or Options().enableExecutableCaching(path), or turn it off with "
                           "%s=%s", self.root, error, DIRECTORY_VARIABLE, DIRECTORY_VARIABLE, OFF)

    def _write(self, path: str, data: bytes) -> None:
        """``data`` at ``path``, whole or not at all (another process may read it)."""
        os.makedirs(self.root, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=self.root, suffix=".partial")
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(data)
            os.replace(temporary, path)
        except BaseException:
            if os.path.exists(temporary):
                os.remove(temporary)
            raise

    def evict(self) -> None:
        """Remove the least recently used entries until the directory fits its bound."""
        entries = []
        with os.scandir(self.root) as listing:
            for item in listing:
                if item.name.endswith((SUFFIX, DECOMPOSITION_SUFFIX)):
                    try:
                        status = item.stat()
                    except FileNotFoundError:
                        continue
                    entries.append((status.st_mtime_ns, status.st_size, item.path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.limit:
                break
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            total -= size


class StagePrograms:
    """An executable source (``xla_compile.executables_from``) for the programs of a model split
    over IPUs: each is looked up in ``cache`` under the model's program key and the fingerprint of
    its own lowered program (so an entry stands in only for the very program it was compiled from), on
    the devices it was compiled for; one not found is compiled and stored."""

    def __init__(self, cache: ExecutableCache, program_key: str):
        self._cache, self._program_key = cache, program_key
        self.loaded = self.compiled = 0

    def __call__(self, lowered):
        key = hashlib.sha256(f"{self._program_key} {serialization.fingerprint(lowered)}".encode()).hexdigest()
        entry = self._cache.load(key, serialization.devices_with_ids)
        if entry is not None:
            self.loaded += 1
            return entry[0]
        executable = xla_compile.compile_now(lowered)
        self._cache.store(key, executable, serialization.device_ids(executable))
        self.compiled += 1
        return executable


class Decompositions:
    """The store of ``compiler.decomposition_cache`` in an executable cache's directory: its
    entries keyed also by what decomposed them (:func:`environment`), bounded with the programs."""

    def __init__(self, cache: ExecutableCache):
        self._cache = cache

    def get(self, key: str) -> bytes | None:
        name = entry_key(("decomposition", key))
        return None if name is None else self._cache.read(name, DECOMPOSITION_SUFFIX)

    def put(self, key: str, data: bytes) -> None:
        name = entry_key(("decomposition", key))
        if name is not None:
            self._cache.write(name, data, DECOMPOSITION_SUFFIX)


def for_setting(setting: str | None) -> ExecutableCache | None:
    """The cache an executor with this ``executable_cache_dir`` setting uses (None: off)."""
    root = directory(setting)
    return None if root is None else ExecutableCache(root)
