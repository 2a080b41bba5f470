"""The half of qurl's SGLang adapter that runs inside an SGLang server process (see the parent
package's docstring). Import-light on purpose: the server's environment has torch and sglang,
not megatron or transformers, and only tp_group.py imports sglang."""
