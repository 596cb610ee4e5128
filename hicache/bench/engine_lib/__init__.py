"""Parts of ``hicache bench engine`` that tests share: a vLLM engine driven in a child process."""
