-- The pipeline's action vocabulary and stage layout: what one entry of a rank's schedule is, its
-- compact text form ("F3.c0", "SEND_F3.c0->1"), and which rank holds which virtual stage.
--
-- An action is a plain table { op = OP, mb = m, chunk = c [, peer = p] }: micro-batch m (from 0),
-- model chunk c of the rank that runs it (from 0), and for communication the other rank.
--   F       forward of micro-batch m through chunk c                 text  F3.c0
--   B       backward of micro-batch m through chunk c                text  B3.c0
--           (when the rank's list also holds W m.c: the input's gradient only)
--   W       the weights' gradients of a micro-batch whose B ran      text  W3.c0
--   SEND_F  send the activation F m.c produced to the next stage     text  SEND_F3.c0->1
--   RECV_F  receive the activation F m.c takes from the previous one text  RECV_F3.c1<-0
--   SEND_B  send the gradient B m.c produced to the previous stage   text  SEND_B3.c1->0
--   RECV_B  receive the gradient B m.c takes from the next stage     text  RECV_B3.c0<-1
-- The chunk of a send or receive is always the chunk of the rank it runs on: SEND_F3.c1->0 on the
-- last rank feeds F3.c2 on rank 0. In text, ".c0" may be left out when parsing ("F3" is F3.c0).
--
-- Layout: with pp ranks and `chunks` chunks a rank there are pp * chunks virtual stages.
-- "interleaved" (Megatron's, the default): chunk c of rank r is virtual stage c * pp + r; "v"
-- (ZB-V's): the odd chunks run back, c * pp + pp - 1 - r, so with 2 chunks rank 0 holds the first
-- stage and the last, and consecutive stages pp - 1 and pp are on one rank. Micro-batches flow
-- through the virtual stages in order; the first has no previous stage (no RECV_F, no SEND_B),
-- the last has no next one (no SEND_F, no RECV_B) and computes the loss in its forward.
local A = {}

A.COMPUTE = { F = true, B = true, W = true }
A.COMM = { SEND_F = true, RECV_F = true, SEND_B = true, RECV_B = true }
A.OPS = { "F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B" }
--- The stage layouts a plan may name (plan.layout; nil is "interleaved").
A.LAYOUTS = { interleaved = true, v = true }

function A.action(op, mb, chunk, peer) return { op = op, mb = mb, chunk = chunk or 0, peer = peer } end

local function is_int(x) return type(x) == "number" and x == math.floor(x) and x > -2^52 and x < 2^52 end
A.is_int = is_int

--- The text form of an action ("F3.c0", "SEND_F3.c0->1", "RECV_B3.c1<-2"); anything that is not
--- an action table prints as `tostring` would (messages about broken actions use it too).
function A.format(a)
  if type(a) ~= "table" then return type(a) == "string" and ("%q"):format(a) or tostring(a) end
  local s = tostring(a.op) .. tostring(a.mb) .. ".c" .. tostring(a.chunk)
  if a.op == "SEND_F" or a.op == "SEND_B" then return s .. "->" .. tostring(a.peer) end
  if a.op == "RECV_F" or a.op == "RECV_B" then return s .. "<-" .. tostring(a.peer) end
  return s
end

--- The action a text names, or nil and what is wrong with the text.
function A.parse(text)
  if type(text) ~= "string" then return nil, "an action must be a table or a string, got " .. type(text) end
  local op, mb, rest = text:match("^%s*([%u_]+)(%d+)(.-)%s*$")
  local chunk, arrow, peer = "0", nil, nil
  if rest and rest ~= "" then
    local c, tail = rest:match("^%.c(%d+)(.*)$")
    if c then chunk, rest = c, tail end
    if rest ~= "" then arrow, peer = rest:match("^([<>-]+)(%d+)$") end
    if rest ~= "" and not arrow then op = nil end
  end
  if not op or not (A.COMPUTE[op] or A.COMM[op]) or (A.COMM[op] and not arrow) or (A.COMPUTE[op] and arrow)
     or (arrow and arrow ~= (op:sub(1, 4) == "SEND" and "->" or "<-")) then
    return nil, ("'%s' is not an action (write e.g. F3.c0, B3.c0, W3.c0, SEND_F3.c0->1, RECV_F3.c1<-0, SEND_B3.c1->0, RECV_B3.c0<-1)"):format(text)
  end
  return A.action(op, tonumber(mb), tonumber(chunk), peer and tonumber(peer))
end

--- The virtual stage of chunk c on rank r, and the rank and chunk of a virtual stage, under
--- `layout` ("interleaved" or nil, or "v").
function A.stage(pp, r, c, layout)
  if layout == "v" and c % 2 == 1 then return c * pp + pp - 1 - r end
  return c * pp + r
end
function A.place(pp, v, layout)
  local c = math.floor(v / pp)
  if layout == "v" and c % 2 == 1 then return pp - 1 - v % pp, c end
  return v % pp, c
end

return A
