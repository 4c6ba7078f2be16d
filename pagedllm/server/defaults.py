"""Defaults of the server's protective limits, in a module with no imports so that ``--help`` stays fast."""

MAX_WAITING_REQUESTS = 256       # engine requests that may wait beyond --max-num-seqs running ones
MAX_REQUEST_BODY_BYTES = 4 * 2**20  # 4 MiB: a full 8k-token chat with tools is about 100 KB
# audio uploads (/v1/audio/transcriptions, /translations) may be as large as OpenAI's file limit, 25 MB
# (vLLM's VLLM_MAX_AUDIO_CLIP_FILESIZE_MB default), or --max-request-body-bytes when that is larger
AUDIO_UPLOAD_BYTES = 25 * 2**20
AUDIO_UPLOAD_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")
SHUTDOWN_TIMEOUT_S = 30.0        # seconds running requests may take to finish after SIGTERM
