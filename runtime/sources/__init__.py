"""Model sources: where weights come from (hf://, s3://, pvc://, file://) and how `kvserve download` fetches them.

`uri` (pure) and `model_config` (fetches one config.json) are torch-free seams the operator may import; the
downloader (`download`, `hub`, `s3`, `local`) runs in the engine pod's init container.
"""
