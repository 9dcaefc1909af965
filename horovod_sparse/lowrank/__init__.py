"""Low-rank gradient compression: PowerSGD (Vogels et al., NeurIPS'19).

:class:`PowerSGDPipeline` has the pipeline interface of
:class:`~horovod_sparse.sparsify.Sparsifier` (``step``, ``last``, ``traffic``,
``state_dict``/``load_state_dict``, ``close``) and runs on the gradient's own library and
device; :mod:`.plan` decides which gradients are compressed, :mod:`.factors` does the
matrix products in place, :mod:`.orthogonal` orthonormalises P deterministically.
"""
from .plan import MatrixBlock, Plan, make_plan
from .powersgd import PowerSGDPipeline, PowerSGDStepInfo

__all__ = ["PowerSGDPipeline", "PowerSGDStepInfo", "MatrixBlock", "Plan", "make_plan"]
