"""Multi-LoRA serving (issue 24): PEFT adapters applied per token inside a mixed batch, never merged."""
