"""
The transformers face of model.py, for the directories checkpoints.save_hf writes for the routed modes.
It is copied into such a directory next to model.py, and config.json's auto_map points here, so that

    AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)

builds model.py's GPT itself (no second implementation): GPTForCausalLM only holds it as `model` and
speaks transformers' conventions (outputs, labels, generate()). Not imported by the repo's own code
(the relative import only works inside such a directory).

generate() works with a KV cache: model.py's KVCache, created by the first forward and handed back to
generate(), which then feeds only the new tokens (greedy decoding and sampling; beam search, which
reorders caches, is not supported). Padding is not: GPT has no attention mask, so batches must hold
sequences of one length (lm-evaluation-harness's log-likelihoods pad on the right, after the scored
tokens, which a causal model never sees).
"""
import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .model import GPT, GPTConfig, KVCache, rope_tables

# what the installed transformers calls the cache in outputs and generate()'s model inputs
CACHE = 'cache' if 'cache' in CausalLMOutputWithPast.__dataclass_fields__ else 'past_key_values'


class GPTHFConfig(PretrainedConfig):
    model_type = 'qwen3_attention_residuals'     # checkpoints.MODEL_TYPE

    def gpt_config(self):
        """config.json's Qwen3 fields and our 'attention_residuals' entry -> model.py's GPTConfig."""
        rope_theta = getattr(self, 'rope_theta', None) or (getattr(self, 'rope_parameters', None) or {})['rope_theta']
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.max_position_embeddings,
                         n_layer=self.num_hidden_layers, n_head=self.num_attention_heads,
                         n_kv_head=self.num_key_value_heads, n_embd=self.hidden_size, head_dim=self.head_dim,
                         intermediate_size=self.intermediate_size, rope_theta=rope_theta,
                         rms_norm_eps=self.rms_norm_eps, tie_embeddings=self.tie_word_embeddings,
                         **self.attention_residuals)


class GPTForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = GPTHFConfig
    base_model_prefix = 'model'
    _tied_weights_keys = {'model.lm_head.weight': 'model.embed_tokens.weight'}   # used when tie_word_embeddings
    _no_split_modules = ['Layer']

    def __init__(self, config):
        super().__init__(config)
        self.model = GPT(config.gpt_config())
        self.post_init()

    def _init_weights(self, module):
        # transformers builds the model on the meta device and loads the saved tensors into it; the
        # RoPE tables are no saved tensors (model.py computes them at construction), so compute them here
        if isinstance(module, GPT):
            cos, sin = rope_tables(module.config.head_dim, module.config.block_size, module.config.rope_theta)
            with torch.no_grad():
                module.rope_cos.copy_(cos)
                module.rope_sin.copy_(sin)

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False    # generate() must not make its own cache: the first forward makes a KVCache

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.model.lm_head

    def forward(self, input_ids, attention_mask=None, labels=None, use_cache=None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("attention_mask has zeros (padding): this model has no attention mask; pass "
                             "sequences of one length, or pad on the right and ignore the logits there")
        cache = kwargs.get(CACHE)
        if not isinstance(cache, KVCache):
            cache = KVCache(self.model.config.n_layer) if use_cache else None
        logits, _ = self.model(input_ids, kv_cache=cache)
        loss = None
        if labels is not None:   # transformers' convention: labels are the inputs; predict each next one
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE: cache})

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, use_cache=None, **kwargs):
        cache = kwargs.get(CACHE)
        if isinstance(cache, KVCache):
            input_ids = input_ids[:, cache.pos:]      # the tokens the cache has not seen yet
        return {'input_ids': input_ids, 'attention_mask': attention_mask, 'use_cache': use_cache, CACHE: cache}
