"""One remote file fetched whole, through any fsspec filesystem, with bounded retries.

A file is read in ranges of ``CHUNK`` bytes (``cat_file(path, start, end)``: one ranged GET each over
HTTP and S3), so a dropped connection costs at most a range, the fetch resumes where it stopped, and no
process holds more than a range in its heap. Its size comes from the manifest, so nothing is probed
first. A range that fails (a dropped connection, a 5xx, a stall past ``timeout``) is retried after a
backoff of ``backoff * 2**k`` seconds, at most ``retries`` times in all for the file; a whole file whose
sha256 is not the manifest's (the shard changed on the server) is fetched again from its start, counted
the same way. Then one ``RemoteError`` line names the file and its URL, credentials and query removed
(:func:`redact`). A missing file (404) or a refusal (403) is not retried: no wait changes it.

Retries and timeouts: ``PACKER_FETCH_RETRIES`` (default 5), ``PACKER_FETCH_TIMEOUT`` seconds without a
byte (default 60) and ``PACKER_FETCH_BACKOFF`` seconds (default 0.5), read when a fetch starts.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, RemoteError

CHUNK = 1 << 20  # bytes per ranged read: small beside a shard (and in the heap), large beside a request's latency

__all__ = ["Policy", "fetch_bytes", "fetch_file", "filesystem", "redact"]


def redact(text: str) -> str:
    """``text`` with every URL's credentials (``user:secret@``) and query (signed URLs carry their key
    there) removed, so an error line can name the URL."""
    text = re.sub(r"([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]*@", r"\1", str(text))
    return re.sub(r"(://[^\s?'\"]*)\?[^\s'\"]*", r"\1", text)


def _env_number(name: str, default: float, kind: type) -> float:
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        number = kind(value)
    except ValueError:
        number = -1
    if number < 0:
        raise ConfigError(f"${name} {value!r}: need a number >= 0")
    return number


@dataclass(frozen=True, slots=True)
class Policy:
    """How hard a fetch tries: ``retries`` in all per file, ``backoff`` seconds doubled each time,
    ``timeout`` seconds without progress on a read."""

    retries: int = 5
    backoff: float = 0.5
    timeout: float = 60.0

    @classmethod
    def from_env(cls) -> Policy:
        return cls(int(_env_number("PACKER_FETCH_RETRIES", 5, int)), _env_number("PACKER_FETCH_BACKOFF", 0.5, float),
                   _env_number("PACKER_FETCH_TIMEOUT", 60.0, float))


def _options(protocol: str, timeout: float) -> dict:
    """The storage options that bound a stalled read, for the filesystems whose packages take one; other
    filesystems keep their own defaults (their fsspec configuration applies as ever)."""
    if protocol in ("http", "https"):
        import aiohttp  # fsspec's HTTP filesystem is built on it

        return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)}}
    if protocol in ("s3", "s3a"):
        return {"config_kwargs": {"connect_timeout": timeout, "read_timeout": timeout}}
    return {}


def filesystem(url: str, timeout: float | None = None):
    """``(fs, path)`` of a URL, with the read timeout of ``timeout`` where its filesystem takes one."""
    from fsspec.core import url_to_fs  # fsspec comes with datasets

    protocol = url.split("://", 1)[0].lower()
    try:
        return url_to_fs(url, **_options(protocol, Policy.from_env().timeout if timeout is None else timeout))
    except (ImportError, ValueError) as e:
        raise RemoteError(f"{redact(url)}: cannot open this filesystem ({redact(str(e))}); install its fsspec "
                          "package (s3fs, gcsfs, huggingface_hub, aiohttp for http)") from e


def _final(e: BaseException) -> bool:
    """A failure no retry changes: the file is not there, or we may not read it."""
    return isinstance(e, FileNotFoundError | PermissionError | IsADirectoryError) or getattr(e, "status", 0) in (401, 403, 404)


def _reason(e: BaseException) -> str:
    text = redact(str(e)).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(e).__name__}: {line[:200]}" if line else type(e).__name__


class _Changed(Exception):
    """The whole file arrived and is not the one the manifest records."""


def _read_range(fs, path: str, start: int, end: int) -> bytes:
    data = fs.cat_file(path, start=start, end=end)
    if len(data) != end - start:
        what = "short" if len(data) < end - start else "long"
        raise _Changed(f"bytes {start}-{end - 1} came back {what} ({len(data):,} bytes, not {end - start:,}): the file on "
                       "the server is not the manifest's size, or the server ignores range requests")
    return data


def fetch_file(url: str, dest: Path, size: int, sha256: str | None, *, what: str, policy: Policy | None = None,
               on_bytes: Callable[[int], None] | None = None) -> None:
    """Write the ``size`` bytes at ``url`` to ``dest``, checked against ``sha256`` as they arrive;
    retried per the module's rules, then a RemoteError naming ``what`` (a shard's file name) and the URL."""
    policy = policy or Policy.from_env()
    fs, path = filesystem(url, policy.timeout)
    tries = 0
    with open(dest, "wb") as out:
        digest, done = hashlib.sha256(), 0
        while True:
            try:
                while done < size:
                    end = min(size, done + CHUNK)
                    data = _read_range(fs, path, done, end)
                    out.write(data)
                    digest.update(data)
                    done = end
                    if on_bytes is not None:
                        on_bytes(len(data))
                if sha256 is not None and digest.hexdigest() != sha256:
                    raise _Changed("its sha256 is not the manifest's: the file changed on the server")
                out.flush()
                return
            except Exception as e:  # every transport's errors: aiohttp, botocore, OSError, timeouts
                if _final(e):
                    raise RemoteError(f"{what} at {redact(url)}: {_reason(e)}; the file is not there or not readable "
                                      "with these credentials") from e
                tries += 1
                if tries > policy.retries:
                    why = str(e) if isinstance(e, _Changed) else f"the server failed ({_reason(e)})"
                    raise RemoteError(f"{what} at {redact(url)}: {why}, {tries} tries; check the server, or republish "
                                      "the build if it changed (`packer push`)") from e
                if isinstance(e, _Changed):  # the file may have been replaced mid-fetch: start it over
                    out.seek(0)
                    out.truncate()
                    digest, done = hashlib.sha256(), 0
                time.sleep(policy.backoff * 2 ** (tries - 1))


def fetch_bytes(url: str, *, what: str, policy: Policy | None = None) -> bytes:
    """A small file (a manifest) whole, retried per the module's rules; a missing one is FileNotFoundError."""
    policy = policy or Policy.from_env()
    fs, path = filesystem(url, policy.timeout)
    tries = 0
    while True:
        try:
            return fs.cat_file(path)
        except Exception as e:  # as in fetch_file
            if isinstance(e, FileNotFoundError) or getattr(e, "status", 0) == 404:
                raise FileNotFoundError(redact(url)) from e
            tries += 1
            if _final(e) or tries > policy.retries:
                raise RemoteError(f"{what} at {redact(url)}: {_reason(e)}, {tries} tries; check the server and the "
                                  "credentials") from e
            time.sleep(policy.backoff * 2 ** (tries - 1))
