"""What the stages keep on disk: crash-safe files and JSONL records (``files``), sharded record
folders (``shards``), one writer per folder (``locks``) and model folders with their manifests
(``model_folders``)."""
