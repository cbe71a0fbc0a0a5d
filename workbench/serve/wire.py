"""The Tinker wire format the SDK speaks for its two large payloads, in protobuf.

`forward_backward` requests arrive as `tinker_public.ForwardBackwardRequest` (optionally zstd
compressed), and the SDK asks for `ForwardBackwardOutput` and `SampleResponse` results as
protobuf (`Accept: application/x-protobuf`); everything else is JSON. The message classes are
the SDK's own generated module (`tinker.proto.tinker_public_pb2`), so the service reads and
writes exactly the schema the client was built with; only plain bytes of numbers cross here
(no pickles).

    req = decode_forward_backward(body, content_encoding)   # -> FwdBwdRequest (numpy arrays)
    blob = encode_forward_backward(outputs, metrics)        # -> bytes for retrieve_future
    blob = encode_sample(sequences, prompt_logprobs)        # -> bytes for retrieve_future
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.serve.futures import ServeError


def pb():
    """The SDK's generated protobuf module (imported when a request needs it)."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as exc:  # pragma: no cover - the service checks at start-up
        raise ServeError("the Tinker wire format needs the `tinker` package: pip install 'workbench[serve]'") from exc
    return tinker_public_pb2


# proto DType -> numpy (the SDK sends float32 and int64; int32 and bf16 are read for completeness)
def _np_dtype(code: int):
    p = pb()
    table = {p.DTYPE_FLOAT32: np.float32, p.DTYPE_INT64: np.int64, p.DTYPE_INT32: np.int32,
             p.DTYPE_BFLOAT16: np.uint16}
    if code not in table:
        raise ServeError(f"a loss_fn_inputs tensor has an unknown dtype code {code}")
    return table[code]


@dataclass
class Datum:
    tokens: list[int]  # the model input, every chunk's tokens in order
    inputs: dict[str, np.ndarray]  # loss_fn_inputs by name, dense


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def tensor(msg) -> np.ndarray:
    """A dense numpy array from a `tinker_public.Tensor` (dense bytes or sparse CSR)."""
    dtype = _np_dtype(msg.dtype)
    shape = [int(s) for s in msg.shape]
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
            raise ServeError(f"a sparse loss_fn_inputs tensor is malformed (shape {shape})")
        dense = np.zeros(shape, dtype=dtype)
        for r in range(shape[0]):
            dense[r, col[crow[r]:crow[r + 1]]] = values[crow[r]:crow[r + 1]]
        out = dense
    else:
        out = np.frombuffer(msg.dense, dtype=dtype)
        if shape:
            if int(np.prod(shape)) != out.size:
                raise ServeError(f"a loss_fn_inputs tensor has {out.size} values for shape {shape}")
            out = out.reshape(shape)
    if dtype is np.uint16:  # bfloat16: the upper half of a float32
        out = (out.astype(np.uint32) << 16).view(np.float32)
    return out.copy()


def decode_forward_backward(body: bytes, content_encoding: str | None) -> FwdBwdRequest:
    if content_encoding and content_encoding.lower() == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
    elif content_encoding and content_encoding.lower() not in ("identity", ""):
        raise ServeError(f"forward_backward: Content-Encoding {content_encoding!r} is not supported (zstd is)")
    msg = pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError
        raise ServeError(f"forward_backward: the request body is not a ForwardBackwardRequest ({exc})") from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():  # v2 wins where both are set (the SDK writes both)
        config[k] = v.text if v.WhichOneof(v.DESCRIPTOR.oneofs[0].name) == "text" else float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof(chunk.DESCRIPTOR.oneofs[0].name)
            if kind != "encoded_text":
                raise ServeError(f"forward_backward: datum {i} has a {kind or 'non-text'} chunk; "
                                 "this service trains on token (encoded_text) inputs only")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        data.append(Datum(tokens, {name: tensor(t) for name, t in d.loss_fn_inputs.items()}))
    return FwdBwdRequest(msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only), data)


def _batched(arrays: list[np.ndarray], code: int):
    """A `BatchedTensor`: the datums' 1-D arrays back to back, with byte offsets."""
    bt = pb().BatchedTensor()
    bt.dtype = code
    flat = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
    offsets = np.zeros(len(flat) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.nbytes for a in flat])
    bt.data = b"".join(a.tobytes() for a in flat)
    bt.offsets = offsets.tobytes()
    return bt


def encode_forward_backward(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """`ForwardBackwardOutput` with one ArrayRecord: per datum, every output field 1-D (float32)."""
    p = pb()
    msg = p.ForwardBackwardOutput()
    msg.loss_fn_output_type = "ArrayRecord"
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    rec = msg.loss_fn_outputs.add()
    rec.type_tag = "ArrayRecord"
    rec.num_datums = len(outputs)
    for name in (outputs[0].keys() if outputs else ()):
        rec.fields[name].CopyFrom(_batched([o[name].astype(np.float32) for o in outputs], p.DTYPE_FLOAT32))
    return msg.SerializeToString()


def encode_sample(sequences: list[tuple[list[int], list[float], str]], prompt_logprobs: list[float] | None) -> bytes:
    """`SampleResponse`: (tokens, logprobs, "stop" | "length") per sequence; prompt log-probs
    with NaN where none is defined (the first prompt token)."""
    p = pb()
    msg = p.SampleResponse()
    for tokens, logprobs, stop in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = p.STOP_REASON_STOP if stop == "stop" else p.STOP_REASON_LENGTH
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
