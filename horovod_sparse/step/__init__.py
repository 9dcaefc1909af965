"""A step's out-of-band gradients exchanged in buckets, the same for every frontend.

:class:`~horovod_sparse.step.exchanges.StepExchanges` is the schedule's runtime the
compressors hand a step's gradients to: one :class:`~horovod_sparse.step.bucket.Bucket` of
the whole step after backward, or, with ``schedule=``, the first steps timed
(:mod:`.profiling`), a plan made (:mod:`horovod_sparse.schedule`) and its buckets exchanged on
channel threads while backward goes on (:mod:`.channels`), ``"auto"`` trying each plan
(:mod:`.trials`). The framework's arrays come in through a frontend's *step arrays* object
(:mod:`.bucket`): PyTorch's tensors, or the numpy arrays (eager TensorFlow tensors on a
device) of TensorFlow's host calls.
"""
