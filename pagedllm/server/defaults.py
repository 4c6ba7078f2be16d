"""Defaults of the server's protective limits, in a module with no imports so that ``--help`` stays fast."""

MAX_WAITING_REQUESTS = 256       # engine requests that may wait beyond --max-num-seqs running ones
MAX_REQUEST_BODY_BYTES = 4 * 2**20  # 4 MiB: a full 8k-token chat with tools is about 100 KB
SHUTDOWN_TIMEOUT_S = 30.0        # seconds running requests may take to finish after SIGTERM
