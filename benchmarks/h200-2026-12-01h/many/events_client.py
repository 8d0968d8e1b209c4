import asyncio, sys, time, random, aiohttp, orjson
url = sys.argv[1]; C = int(sys.argv[2])
async def one(s, rng):
    body = {"input_ids": [rng.randrange(1000, 100000) for _ in range(128)], "sampling_params": {"max_new_tokens": 256, "temperature": 0, "ignore_eos": True}, "stream": True}
    ev = 0; nbytes = 0
    async with s.post(url + "/generate", data=orjson.dumps(body), headers={"content-type": "application/json"}) as r:
        async for line in r.content:
            if line.startswith(b"data:"):
                ev += 1; nbytes += len(line)
    return ev, nbytes
async def main():
    rng = random.Random(0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=C + 4), read_bufsize=1 << 20) as s:
        await one(s, rng)
        t = time.perf_counter()
        res = await asyncio.gather(*(one(s, rng) for _ in range(C)))
        wall = time.perf_counter() - t
    evs = sorted(e for e, _ in res)
    print(f"C={C}: events per request p50 {evs[len(evs)//2]} (min {evs[0]}, max {evs[-1]}), bytes per request p50 {sorted(b for _, b in res)[len(res)//2]}, wall {wall:.2f} s, {C*256/wall:.0f} tok/s (no parse)")
asyncio.run(main())
