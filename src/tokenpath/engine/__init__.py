"""How are tokens made: sequence, KV cache, scheduler, runner, sampler, step loop."""
