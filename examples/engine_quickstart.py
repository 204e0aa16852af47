"""Two compressed turns on the offline SmolLM2 bundle, using the engine directly (the README's usage example)."""

from snapkv_sessions import CompressionConfig, GenerationConfig, ModelRunner, load_model

model, tok = load_model("smollm2-135m-instruct")  # resolved, hash-checked and converted once
runner = ModelRunner(model, tok)
cfg = CompressionConfig.make(budget=128, window=16, kernel=7)  # per layer and KV head
gen = GenerationConfig(max_new_tokens=24)
state = runner.new_state()  # one conversation: cache + true position of every kept slot

system = "<|im_start|>system\nAnswer in one short sentence.<|im_end|>\n"
doc = "".join(f"Room {i} is booked by guest {i * 37 % 101}. " for i in range(40))
turn1 = tok(system + f"<|im_start|>user\n{doc}\nWho booked room 7?<|im_end|>\n<|im_start|>assistant\n")
n_sys = len(tok(system)["input_ids"])
pins = [i < n_sys for i in range(len(turn1["input_ids"]))]  # the system span is never evicted
r1 = runner.turn(state, turn1["input_ids"], cfg, gen, pinned=pins)
print("turn 1:", tok.decode(r1.tokens, skip_special_tokens=True))
print("  kept per layer:", r1.report.tokens_before[0], "->", r1.report.tokens_after[0],
      f"in {r1.report.total_ms:.1f} ms; pinned kept {r1.report.pinned_kept}/{r1.report.pinned_total}")

turn2 = tok("\n<|im_start|>user\nAnd room 8?<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
r2 = runner.turn(state, turn2, cfg, gen)  # prefilled onto turn 1's compressed cache, then compressed again
print("turn 2:", tok.decode(r2.tokens, skip_special_tokens=True))
print("  next true position:", state.next_position, "| slots held per layer:", state.cache_lengths()[0])
print("  layer 0, KV head 0 keeps positions", state.kept_positions(0, 0)[:8], "...")
