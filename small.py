import sys, time, torch; sys.path.insert(0, ".")
import benchmarks.integer_kquants as b
import numpy as np, gguf
from flare.engine import native
torch.set_num_threads(1)
rng=np.random.default_rng(0)
T=gguf.GGMLQuantizationType
for t in (T.Q4_K, T.Q6_K):
    w=b.random_blocks(t,256,2048,rng)
    out=[]
    for rows,h in ((1,2),(4,2),(8,2),(32,2)):
        x=torch.randn(rows,2048)
        xq=native.quantize_q8k_rows(x,h,native.IDOT_AVX512_VNNI)
        f=lambda: native.integer_kquant_linear(xq,w.data,w.ggml_type,256,2048,native.IDOT_AVX512_VNNI)
        f(); n=200; t0=time.thread_time()
        for _ in range(n): f()
        out.append(f"{rows}x{h}: {(time.thread_time()-t0)/n*1e6:7.1f}us")
    print(t.name, " ".join(out))
