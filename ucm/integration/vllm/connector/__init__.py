"""The UCM KV connector for vLLM: the connector itself (ucm_connector), its scheduler half (lookup,
load and dump plans), its worker half (KV moves), the metadata between them, its statistics and
the paged KV layouts it reads and writes."""
