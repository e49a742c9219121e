"""Hidden states as they cross a CPP stage boundary (mooncake/engine/stage.py computes them,
mooncake/prefill/stage_link.py moves them): a wire format, like `kv_payload.py`, under the cluster's key."""

import struct

import msgpack
import torch

from mooncake.errors import KVPayloadError
from mooncake.kv_mac import data_mac, data_mac_ok, header_digest
from mooncake.kv_payload import PREFIX as _PREFIX  # the same framing as KV payloads



def encode_hidden(hidden: torch.Tensor) -> bytes:
    """Hidden states as they cross a stage boundary: u32 header length || u64 keyed digest of the header ||
    msgpack header (dtype, shape, MAC of the data) || raw bytes (mooncake/kv_mac.py, as KV payloads)."""
    host = hidden.detach().to("cpu").contiguous()
    raw = host.view(torch.uint8).numpy().tobytes() if host.numel() else b""
    header = msgpack.packb({"dtype": str(host.dtype).removeprefix("torch."), "shape": list(host.shape),
                            "mac": data_mac(raw)})
    return b"".join((_PREFIX.pack(len(header), header_digest(header)), header, raw))


def decode_hidden(buf: bytes | memoryview, device: torch.device | str = "cpu") -> torch.Tensor:
    """The tensor `encode_hidden` wrote; KVPayloadError if any byte of it changed. A device copy waits for
    the work queued on the device: call it off the event loop."""
    view = memoryview(buf)
    try:
        length, header_sum = _PREFIX.unpack_from(view)
        header_bytes = bytes(view[_PREFIX.size:_PREFIX.size + length])
        if header_digest(header_bytes) != header_sum:
            raise KVPayloadError("hidden states: the header fails its check (corrupted or forged)")
        header = msgpack.unpackb(header_bytes)
        raw = view[_PREFIX.size + length:]
        if not data_mac_ok(raw, header["mac"]):
            raise KVPayloadError("hidden states: the bytes fail their MAC (corrupted or forged)")
        dtype = getattr(torch, header["dtype"])
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
        host = flat.view(dtype).reshape(header["shape"])
    except (struct.error, ValueError, KeyError, TypeError, AttributeError, RuntimeError,
            msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise KVPayloadError(f"hidden states: malformed ({exc})") from None
    # NOTE: outside the try: a device's failure (out of memory) is the device's, not a corrupt payload.
    return host.to(device)
