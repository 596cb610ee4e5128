"""The storage exception tree.

One root, ``StorageError``; each subclass names a kind of failure. The data-path methods of
a backend (``batch_exists``, ``batch_get``, ``batch_set``, ``delete``, ``clear``) never let
these escape: store trouble becomes misses, dropped writes and counters. They are raised by
construction (bad settings, a store that was asked for and cannot be opened) and used
internally to classify failures.
"""

from __future__ import annotations


class StorageError(Exception):
    """Root of every error raised by ``storage_backends``."""


class StorageConfigError(StorageError, ValueError):
    """Settings or a layout that can never work (bad URL, unknown backend, bad size)."""


class StorageUnavailable(StorageError):
    """The store cannot be reached or refused the operation (connection, I/O, permission)."""


class StorageTimeout(StorageUnavailable):
    """The store did not answer within the configured timeout."""


class StorageAuthError(StorageUnavailable):
    """The store refused the credentials (wrong or missing password, unknown user).

    Raised at attach time only; its message names the store (without the password) and
    says "authentication failed", never the secret itself.
    """


class StorageTLSError(StorageUnavailable):
    """The TLS handshake failed: the server's certificate is not trusted by the configured
    CA, does not match the host name, or the server refused our client certificate.

    Raised at attach time only; its message says "certificate verify failed" when the
    server's certificate was rejected, "TLS handshake failed" otherwise.
    """


class StorageCapacityError(StorageUnavailable):
    """The store is out of space (full disk, quota, Redis ``maxmemory`` with noeviction)."""


class PageFormatError(StorageError):
    """An object whose header or checksum does not match what the reader expects."""


class InvalidPageHash(StorageError, ValueError):
    """A key that is not a 64-character lowercase hex page hash."""
