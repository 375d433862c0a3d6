-- The live line: the one line of progress rank 0 rewrites in place (carriage return, clear to
-- the end of the line) on a terminal. Other output goes around it: the line is cleared, the
-- output written, the line drawn again, so log lines scroll above the progress.
local core = require "partrain.core"

local live = { text = nil }   -- what the line shows now (nil: nothing drawn)

local plain_print = print
local wrapped_print   -- print() while a line is drawn

--- Whether stdout is a terminal the line can be drawn on, and its width (0: unknown).
function live.terminal()
  return core.files.stdout_terminal()
end

local function draw()
  io.write("\r", live.text, "\27[K")
  io.flush()
end

--- Draws `text` as the live line (cut to the terminal's width, so it never wraps).
function live.show(text, columns)
  columns = columns and columns > 1 and columns - 1 or 160
  if #text > columns then text = text:sub(1, columns) end
  live.text = text
  -- print() of the script goes around the line too, while a line is drawn.
  if _G.print == plain_print then
    wrapped_print = wrapped_print or function(...)
      local args = { n = select("#", ...), ... }
      live.around(function() plain_print(unpack(args, 1, args.n)) end)
    end
    _G.print = wrapped_print
  end
  draw()
end

--- Runs fn (which writes whole lines) with the live line cleared, then draws the line again.
function live.around(fn)
  if not live.text then return fn() end
  io.write("\r\27[K")
  local ok, err = pcall(fn)
  draw()
  if not ok then error(err, 0) end
end

--- Ends the live line with a newline (it stays on the screen as the last progress), and gives
--- print() back.
function live.finish()
  if live.text then
    io.write("\n")
    io.flush()
  end
  live.text = nil
  if wrapped_print and _G.print == wrapped_print then _G.print = plain_print end
end

return live
