"""Training: self-distillation data from the target (datagen, runtime_replies, batched_replies, anchor_labels), its
shards and manifest (data, manifest, sources), and the drafter's and the Weaver's trainers (train, weaver_train,
loss, text_vocab, draft_vocab, init_from_target). The speculation core never imports this package."""
