"""API keys for `tinkerless serve`: issued once, stored only as sha256 hashes.

A key looks like `tml-<key_id>-<secret>` (the `tml-` prefix is the one the official
`tinker` SDK insists on, so the same key works for both APIs); `key_id` names it in
listings and revocations without revealing it. The key file lives in the server's storage.

A server can also accept one key handed to it through an environment variable
(`tinkerless serve --api-key-env NAME`), which is how cloud launchers give a fresh
server the key their client already holds without writing it anywhere.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
import time
from dataclasses import asdict, dataclass

from tinkerless.errors import StorageNotFound, UserError
from tinkerless.storage import ObjectStore
from tinkerless.storage.names import TENANT_NAME, check_name

KEYS_FILE = "server/api_keys.json"


@dataclass
class KeyRecord:
    key_id: str
    tenant: str
    sha256: str
    created_at: float
    revoked: bool = False
    budget_usd: float | None = None  # what the key may spend on the server's compute (server/budgets.py); None: no limit


MAX_BUDGET_USD = 1e9  # larger is surely a typo (and past what a float counts in cents exactly)


def check_budget(value: object, *, where: str = "budget_usd") -> float | None:
    """A budget in dollars: None (no limit) or a finite number from 0 to MAX_BUDGET_USD; anything else is refused."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value <= MAX_BUDGET_USD:
        raise UserError(f"{where} must be a number of dollars from 0 to {MAX_BUDGET_USD:.0e}, got {value!r}",
                        hint="e.g. --budget-usd 25 (or 'none' for no limit)")
    return float(value)


def parse_budget(text: str) -> float | None:
    """A budget as typed on the command line: dollars ('25', '2.5') or 'none'; NaN, inf, negatives and words are
    refused."""
    if text.strip().lower() == "none":
        return None
    if not _DOLLARS.fullmatch(text.strip()):
        raise UserError(f"--budget-usd {text[:40]!r} is not a number of dollars", hint="e.g. --budget-usd 25, or 'none'")
    return check_budget(float(text), where="--budget-usd")


_DOLLARS = re.compile(r"(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore:
    def __init__(self, store: ObjectStore, *, extra_keys: dict[str, str] | None = None):
        """`extra_keys` maps plaintext keys (held only in memory, as hashes) to their tenants."""
        self.store = store
        self._extra = {_digest(key): tenant for key, tenant in (extra_keys or {}).items()}

    def _load(self) -> list[KeyRecord]:
        try:
            return [KeyRecord(**r) for r in json.loads(self.store.get(KEYS_FILE))]
        except StorageNotFound:
            return []

    def _save(self, records: list[KeyRecord]) -> None:
        self.store.put(KEYS_FILE, json.dumps([asdict(r) for r in records], indent=1).encode())

    def create(self, tenant: str, *, budget_usd: float | None = None) -> str:
        """Issue a key for `tenant` (that may spend `budget_usd`); the plaintext is returned once and never stored."""
        check_name(tenant, TENANT_NAME)
        budget = check_budget(budget_usd)
        key_id = secrets.token_hex(4)
        key = f"tml-{key_id}-{secrets.token_urlsafe(24)}"
        records = self._load()
        records.append(KeyRecord(key_id, tenant, _digest(key), time.time(), budget_usd=budget))
        self._save(records)
        return key

    def set_budget(self, key_id: str, budget_usd: float | None) -> None:
        """Set (None: lift) a key's budget; a running server reads it on the key's next call."""
        budget = check_budget(budget_usd)
        records = self._load()
        matches = [r for r in records if r.key_id == key_id]
        if not matches:
            raise UserError(f"no API key with id {key_id!r}", hint="see `tinkerless keys list`")
        for record in matches:
            record.budget_usd = budget
        self._save(records)

    def record(self, key_id: str) -> KeyRecord | None:
        return next((r for r in self._load() if r.key_id == key_id), None)

    def list(self) -> list[KeyRecord]:
        return self._load()

    def revoke(self, key_id: str) -> None:
        records = self._load()
        matches = [r for r in records if r.key_id == key_id]
        if not matches:
            raise UserError(f"no API key with id {key_id!r}", hint="see `tinkerless keys list`")
        for record in matches:
            record.revoked = True
        self._save(records)

    def tenant_for(self, key: str | None) -> str | None:
        """The tenant a valid, unrevoked key belongs to, else None."""
        found = self.lookup(key)
        return found[0] if found is not None else None

    def lookup(self, key: str | None) -> tuple[str, KeyRecord | None] | None:
        """(tenant, its record) of a valid, unrevoked key (the record is None for a key handed over in the
        environment, which has no budget), else None."""
        if not key:
            return None
        digest = _digest(key)
        for known, tenant in self._extra.items():
            if hmac.compare_digest(known, digest):
                return tenant, None
        for record in self._load():
            if hmac.compare_digest(record.sha256, digest) and not record.revoked:
                return record.tenant, record
        return None
