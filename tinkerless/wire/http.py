"""The HTTP transport's names, shared by `tinkerless serve` and `HTTPBackend`."""

MSGPACK = "application/msgpack"  # request and reply bodies: codec envelopes
COMPUTE_SECONDS_HEADER = "X-Tinkerless-Compute-Seconds"  # reply: the server's timing of the function body
QUEUE_SECONDS_HEADER = "X-Tinkerless-Queue-Seconds"  # reply: how long the call waited in the server's queue first
STREAM_HEADER = "X-Tinkerless-Stream"  # request: one client's calls to a server ...
SEQ_HEADER = "X-Tinkerless-Seq"  # ... run in this order (1, 2, 3, ...), however they arrive
