"""Backward traces: when each gradient is ready and how big it is, plus what each
compressor costs on the device that was traced.

Our JSON format (``format: "horovod_sparse.trace/1"``; written by ``horovod-sparse
profile``)::

    {"format": "horovod_sparse.trace/1", "model": "mlp5", "device": "cpu", "batch": 16,
     "batch_time_s": 0.085,            # forward + backward + update, one worker, median
     "forward_s": 0.03, "update_s": 0.01, "tail_s": 0.0001,   # tail: backward after the last gradient
     "gradients": [                    # BACKWARD order
        {"name": "4.bias", "wait_s": 0.0021, "bytes": 16384, "shape": [4096], "dtype": "float32"}, ...],
     "workers": 1,                     # ranks profiled at once (mpirun -np P): what P ranks pay here
     "compressors": {                  # codec cost on this device at `workers` ranks, per step
        "topk:density=0.01": {"compress_s": 0.001, "decompress_s": 0.41, "carrier": "out_of_band",
                              "sent_fraction": 0.01}, ...},
     "reduce": [[bytes, seconds], ...],   # adding two vectors of that many bytes
     "copy_s": 0.014,                  # one copy of a buffer as large as the model
     "meta": {...}}

``wait_s`` is the backward compute between the previous gradient's readiness (for the
first: the start of backward) and this one's. The NetAI'20 ``.bk.log`` format is read by
:func:`read_bk_log`; ``netai:resnet50`` (``resnet101``, ``vgg16``) names the copies of
the paper's logs shipped in ``horovod_sparse/whatif/netai/``.

    >>> t = load("netai:resnet50")
    >>> len(t.gradients), round(t.batch_time_s, 4), t.nbytes
    (161, 0.1281, 102228128)
"""
import json
import os
from dataclasses import asdict, dataclass, field

FORMAT = "horovod_sparse.trace/1"
NETAI_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netai")
#: Single-GPU batch times of the NetAI'20 simulator (``sd_batch_time``, one V100, batch 32).
NETAI_BATCH_TIME = {"resnet101": 0.19200599479476405, "resnet50": 0.12808580219559176,
                    "vgg16": 0.19452352295080985}


@dataclass
class Gradient:
    """One gradient tensor: ``wait_s`` of backward compute before it is ready, its bytes."""

    name: str
    wait_s: float
    nbytes: int
    shape: list = None
    dtype: str = "float32"

    def to_json(self):
        out = {"name": self.name, "wait_s": self.wait_s, "bytes": int(self.nbytes)}
        if self.shape is not None:
            out["shape"] = list(self.shape)
        out["dtype"] = self.dtype
        return out

    @classmethod
    def from_json(cls, d):
        return cls(str(d["name"]), float(d["wait_s"]), int(d["bytes"]), d.get("shape"), d.get("dtype", "float32"))


@dataclass
class CodecCost:
    """What one compressor costs per step on the traced device, and what it sends.

    ``compress_s``: all ``compress`` calls of a step (run in the gradient hooks, during
    backward); ``decompress_s``: all ``decompress`` calls (after the exchanges; for the
    out-of-band compressors this is where the whole pipeline runs); ``carrier``: "horovod"
    (payload carried by Horovod's allreduce) or "out_of_band" (the package's own exchange after
    backward); ``sent_fraction``: measured fraction of the fused buffer a rank sends, for
    compressors whose count depends on the data; ``wire_ratio``: optional override of
    bytes sent / dense ring bytes."""

    compress_s: float = 0.0
    decompress_s: float = 0.0
    carrier: str = None
    sent_fraction: float = None
    wire_ratio: float = None

    @property
    def codec_s(self):
        return self.compress_s + self.decompress_s

    def to_json(self):
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, d):
        known = {k: d[k] for k in ("compress_s", "decompress_s", "carrier", "sent_fraction", "wire_ratio") if k in d}
        if "codec_s" in d and "compress_s" not in d and "decompress_s" not in d:
            known["decompress_s"] = float(d["codec_s"])   # a single number: all of it after backward
        if known.get("carrier") == "fused":  # traces written before the "out_of_band" vocabulary
            known["carrier"] = "out_of_band"
        return cls(**known)


@dataclass
class Trace:
    """A model's backward trace on one device (see the module docstring for the format)."""

    model: str
    gradients: list
    batch_time_s: float
    device: str = "unknown"
    batch: int = None
    forward_s: float = None
    update_s: float = None
    tail_s: float = 0.0
    compressors: dict = field(default_factory=dict)
    reduce: list = None
    copy_s: float = None
    workers: int = 1     # ranks that ran the profile at once; the codec costs are theirs
    meta: dict = field(default_factory=dict)

    @property
    def backward_s(self):
        """Backward time: the waits plus the tail after the last gradient."""
        return sum(g.wait_s for g in self.gradients) + self.tail_s

    @property
    def nbytes(self):
        return sum(g.nbytes for g in self.gradients)

    @property
    def on_gpu(self):
        """Whether communication can overlap backward: not on a CPU, where the compute and
        Horovod's background thread share the cores."""
        return not str(self.device).lower().startswith("cpu")

    def to_json(self):
        out = {"format": FORMAT, "model": self.model, "device": self.device, "batch": self.batch,
               "batch_time_s": self.batch_time_s, "forward_s": self.forward_s, "update_s": self.update_s,
               "tail_s": self.tail_s, "gradients": [g.to_json() for g in self.gradients],
               "compressors": {k: v.to_json() for k, v in self.compressors.items()},
               "reduce": self.reduce, "copy_s": self.copy_s, "workers": self.workers, "meta": self.meta}
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_json(cls, d):
        if d.get("format") != FORMAT:
            raise ValueError(f"not a horovod_sparse trace (format {d.get('format')!r}, expected {FORMAT!r})")
        return cls(model=d.get("model", "model"), gradients=[Gradient.from_json(g) for g in d["gradients"]],
                   batch_time_s=float(d["batch_time_s"]), device=d.get("device", "unknown"),
                   batch=d.get("batch"), forward_s=d.get("forward_s"), update_s=d.get("update_s"),
                   tail_s=float(d.get("tail_s", 0.0)),
                   compressors={k: CodecCost.from_json(v) for k, v in d.get("compressors", {}).items()},
                   reduce=d.get("reduce"), copy_s=d.get("copy_s"), workers=int(d.get("workers", 1)),
                   meta=d.get("meta", {}))

    def save(self, path):
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")


def read_bk_log(path, batch_time_s=None, vec_add_log=None):
    """A NetAI'20 ``<model>.bk.log`` (comment, batches, layers, then ``wait_us,bytes`` per
    tensor in backward order; the batches are averaged). The batch time defaults to the
    paper's for its three models; the reduction table to ``cuda_vec_add.log`` beside it."""
    with open(path) as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    try:
        batches, layers = int(lines[1]), int(lines[2])
        rows = [tuple(ln.split(",")) for ln in lines[3:3 + batches * layers]]
        waits = [float(w) / 1e6 for w, _ in rows]
        sizes = [int(s) for _, s in rows]
    except (IndexError, ValueError) as e:
        raise ValueError(f"{path}: not a .bk.log (comment, batches, layers, then wait_us,bytes lines): {e}") from None
    if len(rows) != batches * layers:
        raise ValueError(f"{path}: expected {batches * layers} wait_us,bytes lines, found {len(rows)}")
    name = os.path.basename(path).split(".")[0]
    grads = [Gradient(f"{name}.{i}", sum(waits[b * layers + i] for b in range(batches)) / batches,
                      sizes[i]) for i in range(layers)]
    if batch_time_s is None:
        batch_time_s = NETAI_BATCH_TIME.get(name)
    if batch_time_s is None:
        raise ValueError(f"{path}: no batch time known for {name!r}; give one (--batch-time)")
    if vec_add_log is None:
        candidate = os.path.join(os.path.dirname(os.path.abspath(path)), "cuda_vec_add.log")
        vec_add_log = candidate if os.path.exists(candidate) else None
    reduce = read_cost_table(vec_add_log) if vec_add_log else None
    return Trace(model=name, gradients=grads, batch_time_s=float(batch_time_s), device="V100 (NetAI'20)",
                 batch=32, reduce=reduce, meta={"source": os.path.abspath(path)})


def read_cost_table(path):
    """``bytes,seconds`` lines (NetAI's ``cuda_vec_add.log``) -> [[bytes, seconds], ...]."""
    with open(path) as f:
        return [[float(a), float(b)] for a, b in (ln.strip().split(",") for ln in f if ln.strip())]


def resolve(path):
    """``netai:<model>`` -> the shipped log's path; anything else unchanged."""
    if path.startswith("netai:"):
        name = path.split(":", 1)[1]
        if name not in NETAI_BATCH_TIME:
            raise ValueError(f"unknown NetAI trace {path!r}; have " + ", ".join(f"netai:{m}" for m in NETAI_BATCH_TIME))
        return os.path.join(NETAI_DIR, f"{name}.bk.log")
    return path


def load(path, batch_time_s=None):
    """A trace from our JSON, a ``.bk.log``, or ``netai:<model>``; ``batch_time_s`` overrides
    the trace's batch time."""
    path = resolve(path)
    if not os.path.exists(path):
        raise ValueError(f"no such trace file: {path}")
    if path.endswith(".log"):
        return read_bk_log(path, batch_time_s)
    try:
        with open(path) as f:
            trace = Trace.from_json(json.load(f))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: neither a JSON trace nor a .bk.log ({e})") from None
    if batch_time_s is not None:
        trace.batch_time_s = float(batch_time_s)
    return trace
