"""Every error mooncake raises on purpose; callers catch `MooncakeError` to report without a traceback."""


class MooncakeError(Exception):
    """Base of all deliberate mooncake errors. The message is one line a user can act on."""


class ConfigError(MooncakeError):
    """A configuration file or value is wrong; the message names the key."""


def check_config(ok: bool, key: str, why: str) -> None:
    """ConfigError naming `key` and `why` unless `ok`."""
    if not ok:
        raise ConfigError(f"config key '{key}' {why}")


class ModelError(MooncakeError):
    """A model cannot be found, fetched, converted or loaded."""


class UnsupportedModelError(ModelError):
    """The model exists but its architecture is not one we run."""


class InvalidRequestError(MooncakeError):
    """A request's parameters are unusable (prompt too long, max_tokens <= 0, ...); `param`: the field at
    fault, where the raiser names one (the API's 400 names it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class KVPayloadError(MooncakeError):
    """A KV block payload failed verification (checksum, namespace, dtype or shape); `block_hash`: the
    block's, where the raiser names it (so that a reader can drop a bad copy from where it came)."""

    def __init__(self, message: str, block_hash: int | None = None):
        super().__init__(message)
        self.block_hash = block_hash


class BackendError(MooncakeError):
    """A named backend is unknown, or its optional dependency is missing."""


class CapacityError(MooncakeError):
    """A store cannot take a block: it is full and nothing in it may be evicted."""


# -- how a request can end other than finished (the API maps each to its HTTP status) ----------------

class Unavailable(MooncakeError):
    """No live instance can take the request, or no conductor answers (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Rejected(MooncakeError):
    """Admission predicts an SLO miss (HTTP 429 with Retry-After)."""

    def __init__(self, reason: str, message: str, retry_after_s: float):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class RequestError(MooncakeError):
    """The request ended in an error on the way (deadline, refused by an instance, no instance left)."""

    def __init__(self, message: str, is_invalid: bool = False):
        super().__init__(message)
        self.is_invalid = is_invalid


class LegFailed(MooncakeError):
    """A leg cannot go on (its instance died, hung or failed it); the request may migrate. `suspects`
    are the instances not to place the next leg on while others are alive."""

    def __init__(self, message: str, suspects: tuple[str, ...]):
        super().__init__(message)
        self.suspects = suspects
